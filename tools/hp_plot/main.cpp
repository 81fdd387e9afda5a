// hp-plot: turns a training run's metrics file (JSON Lines) into a loss-curve SVG.
//
//   hp-plot RUN_DIR_OR_JSONL [-o OUT.svg] [--title TEXT]
//
// Reads the "train" lines (step, loss) and the "eval" lines (step, eval_loss); every other kind
// and every unknown field is ignored, so the metrics format can grow without breaking the tool.
// The output is a self-contained SVG whose bytes depend only on the input and the flags, so it can
// be committed, diffed and compared in tests. Standard library plus nlohmann/json; no LibTorch.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/flags.h"

namespace {

namespace fs = std::filesystem;

// ---- command line -------------------------------------------------------------------------------

struct Options {
  fs::path input;                    // as given: a run directory or a .jsonl file
  std::optional<fs::path> output;    // -o; derived from the input when absent
  std::optional<std::string> title;  // --title; derived from the input file name when absent
};

// Every failure the user can fix (bad flags, a missing or malformed file, an unwritable output).
// main() turns it into "hp-plot: MESSAGE" and exit code 2; nothing else is expected to be thrown.
struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

const std::vector<hp::tools::Flag<Options>>& flags() {
  static const std::vector<hp::tools::Flag<Options>> table = {
      {{"-o", "--output"},
       "OUT.svg",
       "where to write the SVG",
       [](Options& o, const std::string& v) { o.output = fs::path(v); }},
      {{"--title"},
       "TEXT",
       "the chart title (default: the metrics file name)",
       [](Options& o, const std::string& v) { o.title = v; }},
  };
  return table;
}

void print_help() {
  std::cout << "usage: hp-plot RUN_DIR_OR_JSONL [-o OUT.svg] [--title TEXT]\n\n"
               "Draws the loss curve of a training run as an SVG: the \"train\" lines' loss against step,\n"
               "and the \"eval\" lines' eval_loss as markers. Other kinds of lines and unknown fields are\n"
               "ignored. Given a directory, reads DIR/metrics.jsonl and writes DIR/loss.svg; given a\n"
               "file, writes the file's name with the extension .svg. Prints the output path.\n\n"
               "options:\n"
            << hp::tools::flag_help(flags()) << "\nexit status: 0 on success, 2 on any error (message on stderr).\n";
}

// Returns nullopt after printing help.
std::optional<Options> parse_args(int argc, char** argv) {
  Options options;
  std::vector<std::string> inputs;
  try {
    if (!hp::tools::parse_flags(argc, argv, flags(), options, inputs)) {
      print_help();
      return std::nullopt;
    }
  } catch (const hp::tools::UsageError& e) {
    throw UserError(std::string(e.what()) + " (see hp-plot --help)");
  }
  if (inputs.empty()) throw UserError("no input given (see hp-plot --help)");
  if (inputs.size() > 1) throw UserError("more than one input given ('" + inputs[0] + "' and '" + inputs[1] + "')");
  options.input = inputs[0];
  return options;
}

// ---- reading the metrics ------------------------------------------------------------------------

struct Point {
  double step;
  double loss;
};

struct Metrics {
  std::vector<Point> train;  // sorted by step
  std::vector<Point> eval;   // sorted by step
};

// Larger magnitudes only come from a run that has diverged, and the axis arithmetic (hi - lo)
// would overflow to infinity on them, so they count as unusable like null.
constexpr double kLargestPlottable = 1e300;

// A field that is present, a number, and plottable. Anything else means "not usable", not an
// error: a writer may log null for a loss it could not compute, and we would rather plot the rest.
std::optional<double> plottable_number(const nlohmann::json& object, const char* key) {
  const auto it = object.find(key);
  if (it == object.end() || !it->is_number()) return std::nullopt;
  const double value = it->get<double>();
  if (!(std::fabs(value) <= kLargestPlottable)) return std::nullopt;  // also false for NaN
  return value;
}

std::string kind_of(const nlohmann::json& object) {
  const auto it = object.find("kind");
  return it != object.end() && it->is_string() ? it->get<std::string>() : std::string();
}

bool is_blank(const std::string& line) { return line.find_first_not_of(" \t\r\n") == std::string::npos; }

void sort_by_step(std::vector<Point>& points) {
  // Stable, so that repeated steps (a resumed run) keep the order they were logged in.
  std::stable_sort(points.begin(), points.end(), [](const Point& a, const Point& b) { return a.step < b.step; });
}

Metrics read_metrics(const fs::path& file) {
  std::error_code ec;
  if (!fs::exists(file, ec)) throw UserError(file.string() + ": no such file");
  if (fs::is_directory(file, ec)) throw UserError(file.string() + ": is a directory");
  std::ifstream in(file, std::ios::binary);
  if (!in) throw UserError(file.string() + ": cannot open for reading");

  Metrics metrics;
  long records = 0;  // non-blank lines, to tell an empty file from one without train lines
  std::string line;
  for (long line_number = 1; std::getline(in, line); ++line_number) {
    if (is_blank(line)) continue;  // a trailing newline or a hand edit is not worth failing for
    ++records;
    const nlohmann::json object = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (object.is_discarded()) throw UserError(file.string() + ":" + std::to_string(line_number) + ": not JSON");
    if (!object.is_object()) continue;  // valid JSON but not a record: nothing to plot on this line
    const std::string kind = kind_of(object);
    const std::optional<double> step = plottable_number(object, "step");
    if (!step) continue;
    if (kind == "train") {
      if (const auto loss = plottable_number(object, "loss")) metrics.train.push_back({*step, *loss});
    } else if (kind == "eval") {
      if (const auto loss = plottable_number(object, "eval_loss")) metrics.eval.push_back({*step, *loss});
    }
  }
  if (in.bad()) throw UserError(file.string() + ": read error");
  if (records == 0) throw UserError(file.string() + ": empty, nothing to plot");
  if (metrics.train.empty())
    throw UserError(file.string() +
                    ": no train points (no line with \"kind\":\"train\" and numeric \"step\" and \"loss\")");
  sort_by_step(metrics.train);
  sort_by_step(metrics.eval);
  return metrics;
}

// ---- number formatting --------------------------------------------------------------------------
// Everything goes through snprintf with fixed formats (and the "C" locale, which a program that
// never calls setlocale keeps), so the same input always gives the same bytes.

std::string format(const char* pattern, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), pattern, value);
  return buffer;
}

std::string format_fixed(double value, int decimals) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.*f", decimals, value);
  return buffer;
}

// Pixel coordinates: a tenth of a pixel is finer than any screen and keeps the file small.
std::string coord(double pixels) { return format_fixed(pixels, 1); }

// Losses in the summary: four significant digits reads well for 3.2 as well as for 0.00012.
std::string format_loss(double loss) { return format("%.4g", loss); }

// Steps are integers in practice; only print decimals if someone logged fractional steps.
std::string format_step(double step) {
  return step == std::floor(step) && std::fabs(step) < 1e15 ? format_fixed(step, 0) : format("%g", step);
}

// ---- axis ticks ---------------------------------------------------------------------------------

struct Axis {
  double lo;     // the axis starts here (the first tick)
  double hi;     // and ends here (the last tick)
  double step;   // distance between ticks
  int ticks;     // number of ticks, lo and hi included
  int decimals;  // decimals that show every tick label exactly
};

// The "nice number" of Heckbert's Graphics Gems algorithm: 1, 2, 5 or 10 times a power of ten.
double nice_number(double x, bool round_to_nearest) {
  const double exponent = std::floor(std::log10(x));
  const double fraction = x / std::pow(10.0, exponent);
  double nice;
  if (round_to_nearest)
    nice = fraction < 1.5 ? 1 : fraction < 3 ? 2 : fraction < 7 ? 5 : 10;
  else
    nice = fraction <= 1 ? 1 : fraction <= 2 ? 2 : fraction <= 5 ? 5 : 10;
  return nice * std::pow(10.0, exponent);
}

// A single value (one point, or a flat curve) still needs a range to draw against.
std::pair<double, double> widen_if_flat(double lo, double hi) {
  if (hi > lo) return {lo, hi};
  const double pad = lo != 0 ? std::fabs(lo) * 0.05 : 1.0;
  return {lo - pad, hi + pad};
}

// Round ticks covering [lo, hi], about `target` of them, never closer than `min_step`.
Axis nice_axis(double data_lo, double data_hi, int target, double min_step) {
  const auto [lo, hi] = widen_if_flat(data_lo, data_hi);
  const double step = std::max(min_step, nice_number(nice_number(hi - lo, false) / (target - 1), true));
  Axis axis{lo, hi, hi - lo, 2, 0};
  // Values near the limits of double (a diverged run) can overflow the arithmetic above; then
  // the plain data range with two ticks is still a correct, if less pretty, axis.
  if (!std::isfinite(step) || step <= 0) return axis;
  // The slack keeps rounding error (0.95 / 0.05 = 18.999...) from adding a tick beyond the data.
  const double first = std::floor(lo / step + 1e-9) * step;
  const double last = std::ceil(hi / step - 1e-9) * step;
  const double count = std::round((last - first) / step) + 1;
  if (!std::isfinite(first) || !std::isfinite(last) || !(count >= 2 && count <= 100)) return axis;
  axis = {first, last, step, static_cast<int>(count), 0};
  axis.decimals = static_cast<int>(std::clamp(-std::floor(std::log10(step)), 0.0, 12.0));
  return axis;
}

double tick_value(const Axis& axis, int i) {
  const double value = axis.lo + i * axis.step;              // not accumulated, so no drift
  return std::fabs(value) < axis.step * 1e-9 ? 0.0 : value;  // avoid "-0.0" labels
}

struct LabelUnit {
  double size;
  const char* suffix;
};

// Long runs have six- and seven-digit steps, which crowd an 800 px axis: "150k" reads faster than
// "150000". A unit is only chosen when every tick is a whole number of it, so no label is rounded.
LabelUnit label_unit(const Axis& axis) {
  const double largest = std::max(std::fabs(axis.lo), std::fabs(axis.hi));
  const auto whole = [&](double unit) { return std::fmod(axis.step, unit) == 0 && std::fmod(axis.lo, unit) == 0; };
  if (largest >= 1e15) return {1, ""};  // %g territory, see tick_label
  if (largest >= 1e6 && whole(1e6)) return {1e6, "M"};
  if (largest >= 1e4 && whole(1e3)) return {1e3, "k"};
  return {1, ""};
}

std::string tick_label(const Axis& axis, double value) {
  const LabelUnit unit = label_unit(axis);
  if (unit.size > 1) return value == 0 ? "0" : format_fixed(value / unit.size, 0) + unit.suffix;
  // Fixed decimals for the usual ranges; %g keeps huge or tiny magnitudes readable.
  if (std::fabs(value) >= 1e7 || axis.decimals > 6) return format("%g", value);
  return format_fixed(value, axis.decimals);
}

// ---- text in XML --------------------------------------------------------------------------------

// Returns the length of the valid UTF-8 sequence starting at s[i], or 0 if it is not valid.
size_t utf8_sequence_length(const std::string& s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char lead = byte(i);
  size_t length;
  unsigned min_code;
  unsigned code;
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) {
    length = 2;
    min_code = 0x80;
    code = lead & 0x1F;
  } else if ((lead & 0xF0) == 0xE0) {
    length = 3;
    min_code = 0x800;
    code = lead & 0x0F;
  } else if ((lead & 0xF8) == 0xF0) {
    length = 4;
    min_code = 0x10000;
    code = lead & 0x07;
  } else {
    return 0;
  }
  if (i + length > s.size()) return 0;
  for (size_t k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    code = (code << 6) | (byte(i + k) & 0x3F);
  }
  const bool surrogate = code >= 0xD800 && code <= 0xDFFF;
  const bool xml_forbidden = code == 0xFFFE || code == 0xFFFF;
  // code < min_code: an overlong encoding, which UTF-8 forbids so that each character has one spelling.
  if (code < min_code || code > 0x10FFFF || surrogate || xml_forbidden) return 0;
  return length;
}

// Titles come from the command line and from file names, which can hold anything. XML 1.0 has no
// way to write control characters or invalid UTF-8 at all, so those become a space or U+FFFD
// instead of making the SVG unreadable; markup characters are escaped. At most `max_chars` code
// points are kept, so a long title cannot run over the summary text.
std::string xml_text(const std::string& text, size_t max_chars = 1000) {
  std::string out;
  size_t chars = 0;
  for (size_t i = 0; i < text.size(); ++chars) {
    if (chars == max_chars) {
      out += "\xE2\x80\xA6";  // U+2026 HORIZONTAL ELLIPSIS
      break;
    }
    const size_t length = utf8_sequence_length(text, i);
    if (length == 0) {
      out += "\xEF\xBF\xBD";  // U+FFFD REPLACEMENT CHARACTER
      ++i;
      continue;
    }
    const char c = text[i];
    if (length > 1)
      out.append(text, i, length);
    else if (c == '&')
      out += "&amp;";
    else if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '"')
      out += "&quot;";
    else if (c == '\'')
      out += "&apos;";
    else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7F)
      out += ' ';
    else
      out += c;
    i += length;
  }
  return out;
}

// ---- the chart ----------------------------------------------------------------------------------

constexpr int kWidth = 800;
constexpr int kHeight = 480;
constexpr const char* kTrainColour = "#1f77b4";
constexpr const char* kEvalColour = "#d62728";
constexpr size_t kMaxEvalMarkers = 200;  // beyond this the markers merge into a smear; the line stays

// Where the data goes inside the SVG, in pixels: room on the left for y tick labels and the axis
// title, at the top for the title and summary, at the bottom for x tick labels and the axis title.
struct PlotArea {
  double left = 72, right = kWidth - 24, top = 52, bottom = kHeight - 52;
};

struct Chart {
  PlotArea area;
  Axis x;
  Axis y;

  double px(double step) const { return area.left + (step - x.lo) / (x.hi - x.lo) * (area.right - area.left); }
  double py(double loss) const { return area.bottom - (loss - y.lo) / (y.hi - y.lo) * (area.bottom - area.top); }
};

Chart make_chart(const Metrics& metrics) {
  double step_lo = metrics.train.front().step, step_hi = metrics.train.back().step;
  double loss_lo = metrics.train.front().loss, loss_hi = loss_lo;
  bool whole_steps = true;
  for (const auto* points : {&metrics.train, &metrics.eval}) {
    for (const Point& p : *points) {
      step_lo = std::min(step_lo, p.step);
      step_hi = std::max(step_hi, p.step);
      loss_lo = std::min(loss_lo, p.loss);
      loss_hi = std::max(loss_hi, p.loss);
      whole_steps = whole_steps && p.step == std::floor(p.step);
    }
  }
  // A tick at step 1.5 names a step that does not exist; short runs get ticks one step apart.
  const double min_step_tick = whole_steps ? 1.0 : 0.0;
  return Chart{PlotArea{}, nice_axis(step_lo, step_hi, 8, min_step_tick), nice_axis(loss_lo, loss_hi, 6, 0.0)};
}

// A run of 100k steps would give a 100k-point polyline, far more than the ~700 pixel columns can
// show. Keeping the lowest and the highest point of each column draws the same picture (spikes
// included) with at most two points per column.
std::vector<Point> thin_to_pixel_columns(const std::vector<Point>& points, const Chart& chart) {
  const size_t columns = static_cast<size_t>(chart.area.right - chart.area.left);
  if (points.size() <= 4 * columns) return points;
  std::vector<Point> kept;
  size_t begin = 0;
  while (begin < points.size()) {
    const long column = std::lround(chart.px(points[begin].step));
    size_t end = begin;
    size_t lowest = begin, highest = begin;
    for (; end < points.size() && std::lround(chart.px(points[end].step)) == column; ++end) {
      if (points[end].loss < points[lowest].loss) lowest = end;
      if (points[end].loss > points[highest].loss) highest = end;
    }
    kept.push_back(points[std::min(lowest, highest)]);  // in step order, so the line does not double back
    if (lowest != highest) kept.push_back(points[std::max(lowest, highest)]);
    begin = end;
  }
  return kept;
}

std::string polyline(const std::vector<Point>& points, const Chart& chart, const char* colour,
                     const char* extra_attributes) {
  std::string svg = "<polyline fill=\"none\" stroke=\"";
  svg += colour;
  svg += "\" stroke-width=\"1.5\" stroke-linejoin=\"round\"";
  svg += extra_attributes;
  svg += " points=\"";
  for (size_t i = 0; i < points.size(); ++i) {
    if (i > 0) svg += ' ';
    svg += coord(chart.px(points[i].step)) + "," + coord(chart.py(points[i].loss));
  }
  svg += "\"/>\n";
  return svg;
}

std::string text_element(double x, double y, const std::string& attributes, const std::string& escaped_text) {
  const std::string separator = attributes.empty() ? "" : " ";
  return "<text x=\"" + coord(x) + "\" y=\"" + coord(y) + "\"" + separator + attributes + ">" + escaped_text +
         "</text>\n";
}

std::string line_element(double x1, double y1, double x2, double y2, const std::string& attributes) {
  return "<line x1=\"" + coord(x1) + "\" y1=\"" + coord(y1) + "\" x2=\"" + coord(x2) + "\" y2=\"" + coord(y2) + "\" " +
         attributes + "/>\n";
}

std::string grid_and_ticks(const Chart& chart) {
  const PlotArea& a = chart.area;
  std::string svg = "<g font-size=\"11\" fill=\"#333\">\n";
  for (int i = 0; i < chart.x.ticks; ++i) {
    const double value = tick_value(chart.x, i);
    const double x = chart.px(value);
    svg += line_element(x, a.top, x, a.bottom, "stroke=\"#e5e5e5\"");
    svg += line_element(x, a.bottom, x, a.bottom + 5, "stroke=\"#333\"");
    svg += text_element(x, a.bottom + 18, "text-anchor=\"middle\"", tick_label(chart.x, value));
  }
  for (int i = 0; i < chart.y.ticks; ++i) {
    const double value = tick_value(chart.y, i);
    const double y = chart.py(value);
    svg += line_element(a.left, y, a.right, y, "stroke=\"#e5e5e5\"");
    svg += line_element(a.left - 5, y, a.left, y, "stroke=\"#333\"");
    svg += text_element(a.left - 8, y + 4, "text-anchor=\"end\"", tick_label(chart.y, value));
  }
  svg += "</g>\n";
  return svg;
}

std::string axes_and_titles(const Chart& chart) {
  const PlotArea& a = chart.area;
  std::string svg;
  svg += "<rect x=\"" + coord(a.left) + "\" y=\"" + coord(a.top) + "\" width=\"" + coord(a.right - a.left) +
         "\" height=\"" + coord(a.bottom - a.top) + "\" fill=\"none\" stroke=\"#333\"/>\n";
  svg += text_element((a.left + a.right) / 2, kHeight - 14, "font-size=\"13\" text-anchor=\"middle\"", "step");
  const double mid_y = (a.top + a.bottom) / 2;
  svg += text_element(
      18, mid_y, "font-size=\"13\" text-anchor=\"middle\" transform=\"rotate(-90 18 " + coord(mid_y) + ")\"", "loss");
  return svg;
}

std::string curves(const Metrics& metrics, const Chart& chart) {
  std::string svg = polyline(thin_to_pixel_columns(metrics.train, chart), chart, kTrainColour, "");
  if (metrics.eval.empty()) return svg;
  svg += polyline(thin_to_pixel_columns(metrics.eval, chart), chart, kEvalColour, " stroke-dasharray=\"4 3\"");
  if (metrics.eval.size() > kMaxEvalMarkers) return svg;
  svg += "<g fill=\"";
  svg += kEvalColour;
  svg += "\">\n";
  for (const Point& p : metrics.eval)
    svg += "<circle cx=\"" + coord(chart.px(p.step)) + "\" cy=\"" + coord(chart.py(p.loss)) + "\" r=\"3\"/>\n";
  svg += "</g>\n";
  return svg;
}

// Top right inside the plot: loss curves fall from the top left to the bottom right, so this
// corner is the one the data leaves empty most often.
std::string legend(const Metrics& metrics, const Chart& chart) {
  const bool has_eval = !metrics.eval.empty();
  const double width = 110, height = has_eval ? 44 : 26;
  const double x = chart.area.right - width - 8, y = chart.area.top + 8;
  std::string svg = "<g font-size=\"12\">\n";
  svg += "<rect x=\"" + coord(x) + "\" y=\"" + coord(y) + "\" width=\"" + coord(width) + "\" height=\"" +
         coord(height) + "\" fill=\"white\" fill-opacity=\"0.85\" stroke=\"#bbb\"/>\n";
  svg += line_element(x + 8, y + 13, x + 30, y + 13, std::string("stroke=\"") + kTrainColour + "\" stroke-width=\"2\"");
  svg += text_element(x + 36, y + 17, "", "train loss");
  if (has_eval) {
    svg += line_element(x + 8, y + 31, x + 30, y + 31,
                        std::string("stroke=\"") + kEvalColour + "\" stroke-width=\"2\" stroke-dasharray=\"4 3\"");
    svg += "<circle cx=\"" + coord(x + 19) + "\" cy=\"" + coord(y + 31) + "\" r=\"3\" fill=\"" + kEvalColour + "\"/>\n";
    svg += text_element(x + 36, y + 35, "", "eval loss");
  }
  svg += "</g>\n";
  return svg;
}

// The two numbers people look a chart up for, so they need not be read off the axis.
std::string summary(const Metrics& metrics) {
  const Point& last = metrics.train.back();
  std::string eval_line = "no eval loss logged";
  if (!metrics.eval.empty()) {
    const Point best = *std::min_element(metrics.eval.begin(), metrics.eval.end(),
                                         [](const Point& a, const Point& b) { return a.loss < b.loss; });
    eval_line = "min eval loss " + format_loss(best.loss) + " (step " + format_step(best.step) + ")";
  }
  const std::string train_line =
      "final train loss " + format_loss(last.loss) + " (step " + format_step(last.step) + ")";
  std::string svg = "<g font-size=\"11\" fill=\"#555\" text-anchor=\"end\">\n";
  svg += text_element(kWidth - 24, 20, "", xml_text(train_line));
  svg += text_element(kWidth - 24, 36, "", xml_text(eval_line));
  svg += "</g>\n";
  return svg;
}

std::string render_svg(const Metrics& metrics, const std::string& title) {
  const Chart chart = make_chart(metrics);
  std::string svg = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  svg += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + std::to_string(kWidth) + "\" height=\"" +
         std::to_string(kHeight) + "\" viewBox=\"0 0 " + std::to_string(kWidth) + " " + std::to_string(kHeight) +
         "\" font-family=\"sans-serif\">\n";
  svg += "<rect width=\"" + std::to_string(kWidth) + "\" height=\"" + std::to_string(kHeight) + "\" fill=\"white\"/>\n";
  // 48 characters of 16px text end well before the summary, which starts around x = 560.
  svg += text_element(chart.area.left, 30, "font-size=\"16\" font-weight=\"bold\"", xml_text(title, 48));
  svg += summary(metrics);
  svg += grid_and_ticks(chart);
  svg += curves(metrics, chart);
  svg += axes_and_titles(chart);
  svg += legend(metrics, chart);
  svg += "</svg>\n";
  return svg;
}

// ---- paths and output ---------------------------------------------------------------------------

struct Paths {
  fs::path metrics;
  fs::path svg;
};

Paths resolve_paths(const Options& options) {
  std::error_code ec;
  const bool is_dir = fs::is_directory(options.input, ec);
  Paths paths;
  paths.metrics = is_dir ? options.input / "metrics.jsonl" : options.input;
  if (options.output)
    paths.svg = *options.output;
  else if (is_dir)
    paths.svg = options.input / "loss.svg";
  else
    paths.svg = fs::path(options.input).replace_extension(".svg");
  // Only possible for an input that already ends in .svg, but overwriting the data is not undoable.
  if (paths.svg.lexically_normal() == paths.metrics.lexically_normal())
    throw UserError(paths.metrics.string() + ": output would overwrite the input; pass -o");
  return paths;
}

// "run42/metrics.jsonl" rather than "metrics.jsonl": every run has a metrics.jsonl, so the bare
// file name would not tell two charts apart; the directory usually names the run.
std::string default_title(const fs::path& metrics_file) {
  std::error_code ec;
  const fs::path absolute = fs::absolute(metrics_file, ec);
  const fs::path normal = (ec ? metrics_file : absolute).lexically_normal();
  const fs::path parent = normal.parent_path().filename();
  const std::string name = normal.filename().string();
  return parent.empty() || parent == "." ? name : parent.string() + "/" + name;
}

void write_file(const fs::path& file, const std::string& contents) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  if (!out) throw UserError(file.string() + ": cannot open for writing");
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  out.close();
  if (!out) throw UserError(file.string() + ": write failed");
}

int run(const Options& options) {
  const Paths paths = resolve_paths(options);
  const Metrics metrics = read_metrics(paths.metrics);
  const std::string title = options.title ? *options.title : default_title(paths.metrics);
  write_file(paths.svg, render_svg(metrics, title));
  std::cout << paths.svg.string() << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::optional<Options> options = parse_args(argc, argv);
    if (!options) return 0;
    return run(*options);
  } catch (const UserError& e) {
    std::fprintf(stderr, "hp-plot: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {  // out of memory, a filesystem error: still a message, not a crash
    std::fprintf(stderr, "hp-plot: %s\n", e.what());
    return 2;
  }
}

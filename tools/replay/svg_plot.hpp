// The picture glake-replay draws for a trace: reserved bytes per allocator configuration and the
// trace's active bytes over the allocation events, as one self-contained SVG file.
#pragma once

#include <algorithm>
#include <array>
#include <charconv>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace glake::replay {

/// One allocator configuration's run over a trace. Values are bytes after each event
/// (index = event number); they must be finite and non-negative.
struct plot_series {
  std::string name;               ///< configuration name, e.g. "pytorch-default"
  std::vector<double> reserved;   ///< bytes the allocator held from the device
  std::vector<double> active;     ///< bytes in live tensors; the same for every configuration
};

namespace detail {

/// Geometry of the picture in SVG user units. The legend sits right of the plot so it never
/// hides a curve; the picture widens when a legend line is longer than the space left for it.
struct plot_layout {
  static constexpr double height = 560;
  static constexpr double min_width = 1000;
  static constexpr double left = 75;      // room for the y tick labels and the axis title
  static constexpr double top = 45;       // room for the title
  static constexpr double right = 690;    // right edge of the plot area
  static constexpr double bottom = 500;   // room for the x tick labels and the axis title
  static constexpr double legend_x = 710;
  static constexpr std::size_t max_points = 1500;
};

/// A linear axis from 0 to `top` with ticks every `step`, both "nice" (1, 2, 2.5 or 5 times a
/// power of ten) and `top` >= the data maximum.
struct axis {
  double top;
  double step;
};

/// About `target` intervals covering [0, max]; an empty or all-zero range gets [0, 1].
inline axis nice_axis(double max, int target = 5) {
  if (!(max > 0) || !std::isfinite(max)) return {1.0, 0.2};
  double raw = max / target;
  double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double step = 10 * magnitude;
  for (double m : {1.0, 2.0, 2.5, 5.0}) {
    if (m * magnitude >= raw * (1 - 1e-9)) {
      step = m * magnitude;
      break;
    }
  }
  double top = std::ceil(max / step * (1 - 1e-12)) * step;
  return {top, step};
}

/// Fixed notation with `decimals` digits, independent of the global locale (std::to_chars), so
/// the same input gives the same bytes on every machine.
inline std::string fixed(double v, int decimals) {
  if (v == 0) v = 0;  // no "-0.0"
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed, decimals);
  return std::string(buf, r.ptr);
}

/// Fewest decimals (up to 6) that print every multiple of `step` exactly.
inline int decimals_for(double step) {
  for (int d = 0; d < 6; ++d) {
    double scaled = step * std::pow(10.0, d);
    if (std::abs(scaled - std::round(scaled)) < 1e-6 * scaled) return d;
  }
  return 6;
}

inline std::string xml_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

/// Indices of `v` to draw so that at most `max_points` remain (max_points >= 4): the first and
/// last, and per bucket of consecutive indices the one with the smallest and the one with the
/// largest value, in index order. Peaks and troughs survive; the line loses only detail finer
/// than a bucket, which is under a pixel wide at the default budget. O(v.size()).
inline std::vector<std::size_t> min_max_downsample(const std::vector<double>& v,
                                                   std::size_t max_points) {
  std::vector<std::size_t> out;
  const std::size_t n = v.size();
  if (n <= max_points) {
    out.resize(n);
    for (std::size_t i = 0; i < n; ++i) out[i] = i;
    return out;
  }
  const std::size_t buckets = (std::max<std::size_t>(max_points, 4) - 2) / 2;
  out.reserve(2 * buckets + 2);
  auto push = [&](std::size_t i) {
    if (out.empty() || out.back() < i) out.push_back(i);
  };
  push(0);
  for (std::size_t b = 0; b < buckets; ++b) {
    std::size_t lo = b * n / buckets, hi = (b + 1) * n / buckets;
    std::size_t imin = lo, imax = lo;
    for (std::size_t i = lo + 1; i < hi; ++i) {
      if (v[i] < v[imin]) imin = i;
      if (v[i] > v[imax]) imax = i;
    }
    push(std::min(imin, imax));
    push(std::max(imin, imax));
  }
  push(n - 1);
  return out;
}

/// Colour-blind-friendly palette: Okabe & Ito's, with their yellow (unreadable on white) and
/// black (taken by the active line) replaced by Paul Tol's wine and olive. Series past the
/// eighth reuse colours.
inline constexpr std::array<const char*, 8> palette = {
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#882255", "#999933"};

inline double peak(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, x);
  return m;
}

inline void check_values(const std::vector<double>& v, const std::string& series,
                         const char* what) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i]) || v[i] < 0)
      throw std::invalid_argument("svg plot: series '" + series + "' has " + what + " bytes " +
                                  std::to_string(v[i]) + " at event " + std::to_string(i) +
                                  "; expected a finite, non-negative value");
  }
}

/// Event-count label: "2500", "50k", "1.2M".
inline std::string event_label(double v, double step) {
  if (v == 0) return "0";
  if (step >= 1e6) return fixed(v / 1e6, decimals_for(step / 1e6)) + "M";
  if (step >= 1e3) return fixed(v / 1e3, decimals_for(step / 1e3)) + "k";
  return fixed(v, 0);
}

}  // namespace detail

/// The SVG text for `series`; see write_svg. Throws std::invalid_argument if a value is negative
/// or not finite.
inline std::string render_svg(const std::string& title, const std::vector<plot_series>& series) {
  using L = detail::plot_layout;
  constexpr double gb = 1e9;

  // Active is a property of the trace: draw it once, from the first series that carries it.
  const std::vector<double>* active = nullptr;
  std::size_t events = 0;
  double max_bytes = 0;
  for (const auto& s : series) {
    detail::check_values(s.reserved, s.name, "reserved");
    detail::check_values(s.active, s.name, "active");
    if (!active && !s.active.empty()) active = &s.active;
    events = std::max(events, s.reserved.size());
    max_bytes = std::max(max_bytes, detail::peak(s.reserved));
  }
  if (active) {
    events = std::max(events, active->size());
    max_bytes = std::max(max_bytes, detail::peak(*active));
  }

  const detail::axis y = detail::nice_axis(max_bytes / gb);
  // The x axis ends at the last event rather than at a round number: traces are long and a
  // round end could leave a fifth of the plot empty.
  const double x_max = events > 1 ? double(events - 1) : 1.0;
  const double x_step = detail::nice_axis(x_max, 6).step;
  const double plot_w = L::right - L::left, plot_h = L::bottom - L::top;
  auto px = [&](double i) { return L::left + plot_w * i / x_max; };
  auto py = [&](double bytes) { return L::bottom - plot_h * (bytes / gb) / y.top; };

  // Legend lines first: their length decides the picture's width.
  struct legend_entry {
    std::string text, colour;
    bool dashed;
  };
  std::vector<legend_entry> legend;
  for (std::size_t k = 0; k < series.size(); ++k) {
    const auto& s = series[k];
    std::string text = s.name + (s.reserved.empty()
                                     ? " \u2014 no data"
                                     : " \u2014 peak " + detail::fixed(detail::peak(s.reserved) / gb, 2) + " GB");
    legend.push_back({std::move(text), detail::palette[k % detail::palette.size()], false});
  }
  if (active)
    legend.push_back({"active (live tensors) \u2014 peak " + detail::fixed(detail::peak(*active) / gb, 2) + " GB",
                      "#000000", true});
  std::size_t longest = 0;
  for (const auto& e : legend) {
    // Count code points, not bytes, for the width estimate.
    std::size_t chars = 0;
    for (unsigned char c : e.text) chars += (c & 0xC0) != 0x80;
    longest = std::max(longest, chars);
  }
  const double width = std::max(L::min_width, std::ceil(L::legend_x + 34 + 7.0 * double(longest) + 10));

  std::string o;
  o.reserve(64 * 1024);
  auto num = [](double v) { return detail::fixed(v, 1); };
  o += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(width) + "\" height=\"" +
       num(L::height) + "\" viewBox=\"0 0 " + num(width) + " " + num(L::height) +
       "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n";
  o += "<rect x=\"0\" y=\"0\" width=\"" + num(width) + "\" height=\"" + num(L::height) +
       "\" fill=\"#ffffff\"/>\n";
  o += "<text x=\"" + num((L::left + L::right) / 2) + "\" y=\"28.0\" font-size=\"17\" text-anchor=\"middle\" font-weight=\"bold\">" +
       detail::xml_escape(title) + "</text>\n";

  // Grid and ticks.
  const int ydec = detail::decimals_for(y.step);
  const int yticks = int(std::lround(y.top / y.step));
  for (int t = 0; t <= yticks; ++t) {
    double v = t * y.step, yy = L::bottom - plot_h * v / y.top;
    o += "<line x1=\"" + num(L::left) + "\" y1=\"" + num(yy) + "\" x2=\"" + num(L::right) + "\" y2=\"" +
         num(yy) + "\" stroke=\"#e0e0e0\" stroke-width=\"1\"/>\n";
    o += "<text x=\"" + num(L::left - 8) + "\" y=\"" + num(yy + 4) + "\" font-size=\"12\" text-anchor=\"end\">" +
         detail::fixed(v, ydec) + "</text>\n";
  }
  const int xticks = int(std::floor(x_max / x_step * (1 + 1e-9)));
  for (int t = 0; t <= xticks; ++t) {
    double v = t * x_step, xx = px(v);
    o += "<line x1=\"" + num(xx) + "\" y1=\"" + num(L::bottom) + "\" x2=\"" + num(xx) + "\" y2=\"" +
         num(L::bottom + 5) + "\" stroke=\"#000000\" stroke-width=\"1\"/>\n";
    o += "<text x=\"" + num(xx) + "\" y=\"" + num(L::bottom + 19) + "\" font-size=\"12\" text-anchor=\"middle\">" +
         detail::event_label(v, x_step) + "</text>\n";
  }
  o += "<rect x=\"" + num(L::left) + "\" y=\"" + num(L::top) + "\" width=\"" + num(plot_w) + "\" height=\"" +
       num(plot_h) + "\" fill=\"none\" stroke=\"#000000\" stroke-width=\"1\"/>\n";
  o += "<text x=\"" + num((L::left + L::right) / 2) + "\" y=\"" + num(L::height - 18) +
       "\" font-size=\"13\" text-anchor=\"middle\">allocation events</text>\n";
  o += "<text x=\"22.0\" y=\"" + num((L::top + L::bottom) / 2) +
       "\" font-size=\"13\" text-anchor=\"middle\" transform=\"rotate(-90 22.0 " +
       num((L::top + L::bottom) / 2) + ")\">GB (1e9 bytes)</text>\n";

  // Curves; active last so its dashes stay visible where a configuration holds only live bytes.
  auto polyline = [&](const std::vector<double>& v, const std::string& colour, bool dashed) {
    if (v.empty()) return;
    o += "<polyline fill=\"none\" stroke=\"" + colour + "\" stroke-width=\"" + (dashed ? "1.3" : "1.6") + "\"";
    if (dashed) o += " stroke-dasharray=\"6 4\"";
    o += " stroke-linejoin=\"round\" points=\"";
    bool first = true;
    for (std::size_t i : detail::min_max_downsample(v, L::max_points)) {
      if (!first) o += ' ';
      first = false;
      o += num(px(double(i)));
      o += ',';
      o += num(py(v[i]));
    }
    o += "\"/>\n";
  };
  for (std::size_t k = 0; k < series.size(); ++k) polyline(series[k].reserved, legend[k].colour, false);
  if (active) polyline(*active, "#000000", true);

  // Legend.
  for (std::size_t k = 0; k < legend.size(); ++k) {
    double yy = L::top + 12 + 22.0 * double(k);
    o += "<line x1=\"" + num(L::legend_x) + "\" y1=\"" + num(yy - 4) + "\" x2=\"" + num(L::legend_x + 26) +
         "\" y2=\"" + num(yy - 4) + "\" stroke=\"" + legend[k].colour + "\" stroke-width=\"" +
         (legend[k].dashed ? "1.3\" stroke-dasharray=\"6 4\"" : "2.5\"") + "/>\n";
    o += "<text x=\"" + num(L::legend_x + 34) + "\" y=\"" + num(yy) + "\" font-size=\"12\">" +
         detail::xml_escape(legend[k].text) + "</text>\n";
  }
  if (series.empty() && !active)
    o += "<text x=\"" + num((L::left + L::right) / 2) + "\" y=\"" + num((L::top + L::bottom) / 2) +
         "\" font-size=\"14\" text-anchor=\"middle\" fill=\"#666666\">no data</text>\n";
  o += "</svg>\n";
  return o;
}

/// Writes render_svg(title, series) to `path` (about 1000x560): x = event index, y = GB
/// (1e9 bytes) on round ticks; one solid coloured line of reserved bytes per series, one dashed
/// black line of active bytes from the first series that has them, and a legend giving each
/// series' peak reserved in GB. Each line is cut to at most 1500 points by keeping per bucket of
/// events the smallest and the largest value, so peaks survive. Output depends on the input
/// only (not on locale or time). Throws std::runtime_error naming the file if it cannot be
/// written, std::invalid_argument for negative or non-finite values.
inline void write_svg(const std::string& path, const std::string& title,
                      const std::vector<plot_series>& series) {
  const std::string text = render_svg(title, series);
  auto fail = [&](const char* what, int err) {
    throw std::runtime_error("cannot " + std::string(what) + " plot file '" + path +
                             "': " + std::generic_category().message(err));
  };
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) fail("open", errno);
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  int err = errno;
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (!ok) fail("write", err);
}

}  // namespace glake::replay

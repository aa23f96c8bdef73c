// Tests of glake-replay's SVG picture: well-formed output, peaks that survive downsampling,
// escaping, the legend, determinism and the error paths.
#include <doctest/doctest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "svg_plot.hpp"

namespace {

using glake::replay::plot_series;
using glake::replay::render_svg;
namespace detail = glake::replay::detail;

// Checks that every tag is closed in order, that attribute values are quoted and that no raw
// '<' or stray '&' appears in text or attribute values. Returns "" or what is wrong.
std::string xml_problem(const std::string& s) {
  std::vector<std::string> open;
  auto bad_amp = [&](std::size_t i) {
    for (const char* e : {"&amp;", "&lt;", "&gt;", "&quot;", "&apos;"})
      if (s.compare(i, std::char_traits<char>::length(e), e) == 0) return false;
    return true;
  };
  std::size_t i = 0;
  while (i < s.size()) {
    if (s[i] == '&' && bad_amp(i)) return "stray '&' at " + std::to_string(i);
    if (s[i] != '<') {
      if (s[i] == '>') return "raw '>' in text at " + std::to_string(i);
      ++i;
      continue;
    }
    bool closing = i + 1 < s.size() && s[i + 1] == '/';
    std::size_t j = i + (closing ? 2 : 1);
    std::size_t name_end = j;
    while (name_end < s.size() && (std::isalnum(static_cast<unsigned char>(s[name_end])) || s[name_end] == '-'))
      ++name_end;
    std::string name = s.substr(j, name_end - j);
    if (name.empty()) return "tag without a name at " + std::to_string(i);
    // Scan attributes: quoted values may not hold '<' or a stray '&'.
    std::size_t k = name_end;
    bool in_quote = false;
    for (; k < s.size(); ++k) {
      char c = s[k];
      if (c == '"') in_quote = !in_quote;
      else if (in_quote && c == '<') return "'<' in an attribute of <" + name + ">";
      else if (in_quote && c == '&' && bad_amp(k)) return "stray '&' in an attribute of <" + name + ">";
      else if (!in_quote && c == '>') break;
    }
    if (k == s.size()) return "unterminated tag <" + name + ">";
    bool self_closing = s[k - 1] == '/';
    if (closing) {
      if (open.empty() || open.back() != name) return "</" + name + "> closes nothing open";
      open.pop_back();
    } else if (!self_closing) {
      open.push_back(name);
    }
    i = k + 1;
  }
  if (!open.empty()) return "<" + open.back() + "> never closed";
  return "";
}

// The value of attribute `attr` in every element named `tag`, in document order.
std::vector<std::string> attribute_values(const std::string& svg, const std::string& tag,
                                          const std::string& attr) {
  std::vector<std::string> out;
  for (std::size_t at = svg.find("<" + tag + " "); at != std::string::npos;
       at = svg.find("<" + tag + " ", at + 1)) {
    std::size_t end = svg.find('>', at);
    std::size_t a = svg.find(" " + attr + "=\"", at);
    if (a == std::string::npos || a > end) {
      out.push_back("<missing>");
      continue;
    }
    a += attr.size() + 3;
    out.push_back(svg.substr(a, svg.find('"', a) - a));
  }
  return out;
}

std::vector<std::pair<double, double>> parse_points(const std::string& points) {
  std::vector<std::pair<double, double>> out;
  std::istringstream in(points);
  std::string pair;
  while (in >> pair) {
    std::size_t comma = pair.find(',');
    REQUIRE(comma != std::string::npos);
    out.emplace_back(std::stod(pair.substr(0, comma)), std::stod(pair.substr(comma + 1)));
  }
  return out;
}

std::size_t count(const std::string& hay, const std::string& needle) {
  std::size_t n = 0;
  for (std::size_t at = hay.find(needle); at != std::string::npos; at = hay.find(needle, at + 1)) ++n;
  return n;
}

// Noisy but reproducible data: a sawtooth of live bytes and two reserved curves above it.
std::vector<plot_series> synthetic(std::size_t n) {
  std::vector<double> active(n), a(n), b(n);
  std::uint64_t state = 12345;
  for (std::size_t i = 0; i < n; ++i) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    double noise = double(state >> 40) / double(1ULL << 24);  // [0, 1)
    active[i] = 2e9 + 6e9 * double(i % 5000) / 5000.0 + 0.5e9 * noise;
    a[i] = active[i] * 1.3 + 1e9;
    b[i] = active[i] * 1.05;
  }
  return {{"pytorch-default", a, active}, {"glake", b, active}};
}

}  // namespace

TEST_CASE("svg_plot: output is well-formed and has one polyline per series plus one for active") {
  auto series = synthetic(100);
  std::string svg = render_svg("trace", series);
  CHECK(svg.rfind("<svg ", 0) == 0);
  REQUIRE(svg.size() > 7);
  CHECK(svg.substr(svg.size() - 7) == "</svg>\n");
  CHECK(xml_problem(svg) == "");

  auto points = attribute_values(svg, "polyline", "points");
  REQUIRE(points.size() == 3);
  for (const auto& p : points) CHECK(parse_points(p).size() == 100);
  // Exactly one dashed line in the plot (active), drawn in black; reserved lines are solid.
  CHECK(count(svg, "<polyline") == 3);
  auto dashes = attribute_values(svg, "polyline", "stroke-dasharray");
  CHECK(dashes == std::vector<std::string>{"<missing>", "<missing>", "6 4"});
  auto colours = attribute_values(svg, "polyline", "stroke");
  CHECK(colours[0] != colours[1]);
  CHECK(colours[2] == "#000000");
  CHECK(svg.find("active (live tensors)") != std::string::npos);
  CHECK(svg.find(">allocation events<") != std::string::npos);
}

TEST_CASE("svg_plot: the checker itself rejects broken XML") {
  CHECK(xml_problem("<svg><g></svg>") != "");
  CHECK(xml_problem("<svg><text>a < b</text></svg>") != "");
  CHECK(xml_problem("<svg><text>a & b</text></svg>") != "");
  CHECK(xml_problem("<svg><text a=\"x<y\"/></svg>") != "");
  CHECK(xml_problem("<svg><text a=\"x&amp;y\">&lt;</text></svg>") == "");
}

TEST_CASE("svg_plot: long traces are cut to at most 1500 points per line") {
  auto series = synthetic(200000);
  std::string svg = render_svg("long", series);
  auto points = attribute_values(svg, "polyline", "points");
  REQUIRE(points.size() == 3);
  for (const auto& p : points) {
    auto pts = parse_points(p);
    CHECK(pts.size() <= detail::plot_layout::max_points);
    CHECK(pts.size() >= 1000);  // the budget is used, not wasted
    for (std::size_t i = 1; i < pts.size(); ++i) REQUIRE(pts[i - 1].first <= pts[i].first);
  }
  CHECK(xml_problem(svg) == "");
}

TEST_CASE("svg_plot: min-max downsampling keeps extremes, ends and order") {
  std::vector<double> v(100003);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = double((i * 7919) % 1000);
  v[54321] = 5000;  // lone peak
  v[777] = -1;      // lone trough
  auto idx = detail::min_max_downsample(v, 1500);
  CHECK(idx.size() <= 1500);
  CHECK(idx.front() == 0);
  CHECK(idx.back() == v.size() - 1);
  CHECK(std::adjacent_find(idx.begin(), idx.end(), [](auto a, auto b) { return a >= b; }) == idx.end());
  CHECK(std::find(idx.begin(), idx.end(), 54321u) != idx.end());
  CHECK(std::find(idx.begin(), idx.end(), 777u) != idx.end());

  std::vector<double> short_v(10, 1.0);
  CHECK(detail::min_max_downsample(short_v, 1500).size() == 10);
}

TEST_CASE("svg_plot: each series' peak survives downsampling at the right place") {
  using L = detail::plot_layout;
  auto series = synthetic(150001);
  // Spikes at indices that no regular stride of the downsampler would land on.
  series[0].reserved[98765] = 31.4e9;  // highest value of the plot: the axis top is 35
  series[1].reserved[4321] = 17.7e9;
  const detail::axis y = detail::nice_axis(31.4);
  auto py = [&](double bytes) { return L::bottom - (L::bottom - L::top) * bytes / 1e9 / y.top; };
  auto px = [&](double i) { return L::left + (L::right - L::left) * i / 150000; };  // x ends at the last event

  auto points = attribute_values(render_svg("peaks", series), "polyline", "points");
  REQUIRE(points.size() == 3);
  for (std::size_t s = 0; s < 2; ++s) {
    auto pts = parse_points(points[s]);
    auto top = std::min_element(pts.begin(), pts.end(),
                                [](auto a, auto b) { return a.second < b.second; });
    auto& r = series[s].reserved;
    auto peak_at = std::size_t(std::max_element(r.begin(), r.end()) - r.begin());
    CAPTURE(s);
    CHECK(std::abs(top->second - py(r[peak_at])) <= 0.051);
    CHECK(std::abs(top->first - px(double(peak_at))) <= 0.051);
  }
}

TEST_CASE("svg_plot: names and title are XML-escaped") {
  auto series = synthetic(50);
  series[0].name = "a<b&c>\"d\"";
  std::string svg = render_svg("t<&>\"", series);
  CHECK(xml_problem(svg) == "");
  CHECK(svg.find("a&lt;b&amp;c&gt;&quot;d&quot;") != std::string::npos);
  CHECK(svg.find("t&lt;&amp;&gt;&quot;") != std::string::npos);
  CHECK(svg.find("a<b") == std::string::npos);
}

TEST_CASE("svg_plot: legend names each series with its peak reserved in GB, 2 decimals") {
  std::vector<double> active = {1e9, 3e9, 2e9};
  std::vector<plot_series> series = {
      {"pytorch-default", {5e9, 24.3149e9, 20e9}, active},
      {"glake", {1.5e9, 7e9, 6e9}, active},
  };
  std::string svg = render_svg("legend", series);
  CHECK(svg.find(">pytorch-default \u2014 peak 24.31 GB<") != std::string::npos);
  CHECK(svg.find(">glake \u2014 peak 7.00 GB<") != std::string::npos);
  CHECK(svg.find(">active (live tensors) \u2014 peak 3.00 GB<") != std::string::npos);
  // Round y ticks: 0, 5, ..., 25 GB.
  for (const char* tick : {">0<", ">5<", ">10<", ">15<", ">20<", ">25<"}) CHECK(svg.find(tick) != std::string::npos);
  CHECK(detail::nice_axis(24.3149).top == 25);
  CHECK(detail::nice_axis(24.3149).step == 5);
  CHECK(detail::nice_axis(0.7).step == doctest::Approx(0.2));
  CHECK(detail::nice_axis(0.7).top == doctest::Approx(0.8));
}

TEST_CASE("svg_plot: the same input gives the same bytes, in memory and on disk") {
  auto series = synthetic(70000);
  std::string a = render_svg("det", series);
  std::string b = render_svg("det", synthetic(70000));
  CHECK(a == b);

  std::string path = "/tmp/glake_svg_plot_test_" + std::to_string(std::uintptr_t(&a)) + ".svg";
  glake::replay::write_svg(path, "det", series);
  std::ifstream in(path, std::ios::binary);
  std::string on_disk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(path.c_str());
  CHECK(on_disk == a);
}

TEST_CASE("svg_plot: empty input draws no line and does not crash") {
  std::string none = render_svg("nothing", {});
  CHECK(xml_problem(none) == "");
  CHECK(none.find("<polyline") == std::string::npos);
  CHECK(none.find(">no data<") != std::string::npos);

  std::string empty = render_svg("empty", {{"glake", {}, {}}});
  CHECK(xml_problem(empty) == "");
  CHECK(empty.find("<polyline") == std::string::npos);
  CHECK(empty.find("glake \u2014 no data") != std::string::npos);

  // Active comes from the first series that has it.
  std::string mixed = render_svg("mixed", {{"a", {}, {}}, {"b", {1e9, 2e9}, {1e9, 1e9}}});
  CHECK(count(mixed, "<polyline") == 2);
  CHECK(count(mixed, "stroke-dasharray=\"6 4\" stroke-linejoin") == 1);
}

TEST_CASE("svg_plot: errors name the file or the bad value") {
  auto series = synthetic(10);
  const std::string path = "/nonexistent-glake-dir/plot.svg";
  try {
    glake::replay::write_svg(path, "t", series);
    FAIL("write_svg to an unwritable path did not throw");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()).find(path) != std::string::npos);
  }
  series[1].reserved[3] = std::nan("");
  CHECK_THROWS_AS(render_svg("t", series), std::invalid_argument);
  series[1].reserved[3] = -1;
  CHECK_THROWS_AS(render_svg("t", series), std::invalid_argument);
}

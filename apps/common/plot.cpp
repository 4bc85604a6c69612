#include "common/plot.h"

#include "atomic_file.h"

#include <stb/stb_easy_font.h>
#include <stb/stb_image_write.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <stdexcept>

namespace qkv_plot {
namespace {

constexpr Color kWhite{255, 255, 255};
constexpr Color kBlack{20, 20, 20};
constexpr Color kGrid{225, 225, 225};

class Canvas {
 public:
  Canvas(int width, int height)
      : width_(width), height_(height), pixels_(static_cast<size_t>(width) * height * 3, 255) {}

  int width() const { return width_; }
  int height() const { return height_; }

  void pixel(int x, int y, const Color& c) {
    if (x < 0 || y < 0 || x >= width_ || y >= height_) return;
    auto* p = &pixels_[(static_cast<size_t>(y) * width_ + x) * 3];
    p[0] = c[0], p[1] = c[1], p[2] = c[2];
  }

  void rect(int x0, int y0, int x1, int y1, const Color& c) {
    for (int y = std::max(0, y0); y < std::min(height_, y1); ++y)
      for (int x = std::max(0, x0); x < std::min(width_, x1); ++x) pixel(x, y, c);
  }

  // A line `thickness` pixels wide (a square brush moved along Bresenham's line).
  void line(double x0, double y0, double x1, double y1, const Color& c, int thickness = 1) {
    const int steps = static_cast<int>(std::max(std::abs(x1 - x0), std::abs(y1 - y0))) + 1;
    for (int i = 0; i <= steps; ++i) {
      const double t = static_cast<double>(i) / steps;
      const int x = static_cast<int>(std::lround(x0 + t * (x1 - x0)));
      const int y = static_cast<int>(std::lround(y0 + t * (y1 - y0)));
      rect(x - thickness / 2, y - thickness / 2, x - thickness / 2 + thickness, y - thickness / 2 + thickness, c);
    }
  }

  // Text with stb_easy_font, magnified `scale` times; returns the width in pixels.
  int text(int x, int y, const std::string& s, const Color& c, int scale = 1) {
    static char buffer[99999];
    const int quads = stb_easy_font_print(0, 0, const_cast<char*>(s.c_str()), nullptr, buffer, sizeof(buffer));
    const auto* vertices = reinterpret_cast<const float*>(buffer);
    for (int q = 0; q < quads; ++q) {
      const float* v = vertices + q * 16;  // 4 vertices of (x, y, z, rgba as float-sized)
      const int qx0 = static_cast<int>(v[0]), qy0 = static_cast<int>(v[1]);
      const int qx1 = static_cast<int>(v[8]), qy1 = static_cast<int>(v[9]);
      rect(x + qx0 * scale, y + qy0 * scale, x + qx1 * scale, y + qy1 * scale, c);
    }
    return text_width(s, scale);
  }

  static int text_width(const std::string& s, int scale = 1) {
    return stb_easy_font_width(const_cast<char*>(s.c_str())) * scale;
  }

  // Text rotated by 90° (reading upwards), for y-axis labels.
  void vertical_text(int x, int y_center, const std::string& s, const Color& c, int scale = 1) {
    const int w = text_width(s, scale);
    const int h = 12 * scale;
    Canvas scratch(w + 2, h);
    scratch.text(0, 0, s, kBlack, scale);
    for (int sy = 0; sy < h; ++sy)
      for (int sx = 0; sx < w; ++sx)
        if (scratch.pixels_[(static_cast<size_t>(sy) * scratch.width_ + sx) * 3] < 128)
          pixel(x + sy, y_center + w / 2 - sx, c);
  }

  // Encoded in memory, then written as every file of qkv is (atomic_file.h): a crash mid-write
  // never leaves a truncated picture in place of the previous one.
  void save(const std::string& path) const {
    std::string png;
    auto append = [](void* context, void* data, int size) {
      static_cast<std::string*>(context)->append(static_cast<const char*>(data), static_cast<size_t>(size));
    };
    if (!stbi_write_png_to_func(append, &png, width_, height_, 3, pixels_.data(), width_ * 3)) {
      throw std::runtime_error("cannot encode the picture " + path);
    }
    qkv::detail::write_file_atomically(path, png);
  }

 private:
  int width_, height_;
  std::vector<unsigned char> pixels_;
};

std::string format_tick(double value) {
  char text[32];
  const double magnitude = std::abs(value);
  if (value == 0.0) return "0";
  if (magnitude >= 1e4 || magnitude < 1e-3) {
    std::snprintf(text, sizeof(text), "%.0e", value);
  } else if (magnitude >= 10) {
    std::snprintf(text, sizeof(text), "%.0f", value);
  } else {
    std::snprintf(text, sizeof(text), "%.3g", value);
  }
  return text;
}

// Tick positions: "nice" steps on linear axes, powers of ten (or of two, for short ranges) on log axes.
std::vector<double> ticks(double lo, double hi, bool log_axis) {
  std::vector<double> out;
  if (log_axis) {
    const double decades = std::log10(hi) - std::log10(lo);
    const double base = decades < 2.5 ? 2.0 : 10.0;
    for (double t = std::pow(base, std::floor(std::log(lo) / std::log(base))); t <= hi * 1.0001; t *= base) {
      if (t >= lo * 0.9999) out.push_back(t);
    }
    return out;
  }
  const double raw = (hi - lo) / 5;
  const double magnitude = std::pow(10, std::floor(std::log10(raw)));
  double step = magnitude;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * magnitude >= raw) {
      step = m * magnitude;
      break;
    }
  }
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push_back(t);
  return out;
}

void draw_line_plot(Canvas& canvas, const LinePlot& plot, int left, int top, int width, int height) {
  const int margin_left = 70, margin_right = 16, margin_top = 34, margin_bottom = 46;
  const int x0 = left + margin_left, x1 = left + width - margin_right;
  const int y0 = top + margin_top, y1 = top + height - margin_bottom;
  canvas.text(left + (width - Canvas::text_width(plot.title, 2)) / 2, top + 8, plot.title, kBlack, 2);

  double min_x = std::numeric_limits<double>::infinity(), max_x = -min_x, min_y = min_x, max_y = -min_x;
  for (const auto& s : plot.series) {
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
      if ((plot.log_x && s.x[i] <= 0) || (plot.log_y && s.y[i] <= 0)) continue;
      min_x = std::min(min_x, s.x[i]), max_x = std::max(max_x, s.x[i]);
      min_y = std::min(min_y, s.y[i]), max_y = std::max(max_y, s.y[i]);
    }
  }
  if (!std::isfinite(min_x)) min_x = 0, max_x = 1, min_y = plot.log_y ? 0.1 : 0, max_y = 1;
  if (max_x == min_x) max_x = min_x + 1;
  if (max_y == min_y) max_y = plot.log_y ? min_y * 10 : min_y + 1;
  if (plot.y_min && plot.y_max) {
    min_y = *plot.y_min, max_y = *plot.y_max;
  } else if (!plot.log_y) {
    const double pad = 0.05 * (max_y - min_y);
    min_y -= pad, max_y += pad;
  } else {
    min_y /= 1.3, max_y *= 1.3;
  }
  auto map_x = [&](double x) {
    const double t = plot.log_x ? (std::log(x) - std::log(min_x)) / (std::log(max_x) - std::log(min_x))
                                : (x - min_x) / (max_x - min_x);
    return x0 + t * (x1 - x0);
  };
  auto map_y = [&](double y) {
    const double t = plot.log_y ? (std::log(y) - std::log(min_y)) / (std::log(max_y) - std::log(min_y))
                                : (y - min_y) / (max_y - min_y);
    return y1 - t * (y1 - y0);
  };

  for (double t : ticks(min_x, max_x, plot.log_x)) {
    const int x = static_cast<int>(map_x(t));
    canvas.line(x, y0, x, y1, kGrid);
    const auto label = format_tick(t);
    canvas.text(x - Canvas::text_width(label) / 2, y1 + 6, label, kBlack);
  }
  for (double t : ticks(min_y, max_y, plot.log_y)) {
    const int y = static_cast<int>(map_y(t));
    canvas.line(x0, y, x1, y, kGrid);
    const auto label = format_tick(t);
    canvas.text(x0 - 6 - Canvas::text_width(label), y - 4, label, kBlack);
  }
  canvas.line(x0, y1, x1, y1, kBlack);
  canvas.line(x0, y0, x0, y1, kBlack);
  canvas.text(x0 + (x1 - x0 - Canvas::text_width(plot.x_label, 2)) / 2, y1 + 22, plot.x_label, kBlack, 2);
  canvas.vertical_text(left + 6, (y0 + y1) / 2, plot.y_label, kBlack, 2);

  // Curves first, then the legend in the corner the curves cross least, on a white box.
  std::vector<std::pair<double, double>> drawn;  // sampled curve pixels, to place the legend
  for (const auto& s : plot.series) {
    bool has_previous = false;
    double px = 0, py = 0;
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i]) || (plot.log_x && s.x[i] <= 0) ||
          (plot.log_y && s.y[i] <= 0)) {
        has_previous = false;
        continue;
      }
      const double x = map_x(s.x[i]), y = map_y(s.y[i]);
      if (has_previous) {
        canvas.line(px, py, x, y, s.color, 2);
        for (int t = 0; t <= 8; ++t) drawn.emplace_back(px + (x - px) * t / 8, py + (y - py) * t / 8);
      }
      if (s.x.size() <= 24)
        canvas.rect(static_cast<int>(x) - 3, static_cast<int>(y) - 3, static_cast<int>(x) + 4, static_cast<int>(y) + 4,
                    s.color);
      drawn.emplace_back(x, y);
      px = x, py = y, has_previous = true;
    }
  }
  int legend_w = 0, legend_h = 0;
  for (const auto& s : plot.series) {
    if (s.name.empty()) continue;
    legend_w = std::max(legend_w, Canvas::text_width(s.name, 2) + 40);
    legend_h += 22;
  }
  if (legend_h == 0) return;
  legend_h += 6;
  const int corners[4][2] = {{x1 - legend_w - 4, y0 + 4},
                             {x1 - legend_w - 4, y1 - legend_h - 4},
                             {x0 + 4, y0 + 4},
                             {x0 + 4, y1 - legend_h - 4}};
  int best = 0;
  size_t best_hits = SIZE_MAX;
  for (int c = 0; c < 4; ++c) {
    size_t hits = 0;
    for (const auto& [x, y] : drawn) {
      hits +=
          x >= corners[c][0] && x <= corners[c][0] + legend_w && y >= corners[c][1] && y <= corners[c][1] + legend_h;
    }
    if (hits < best_hits) best_hits = hits, best = c;
  }
  const int lx = corners[best][0], ly = corners[best][1];
  canvas.rect(lx, ly, lx + legend_w, ly + legend_h, kWhite);
  int legend_y = ly + 4;
  for (const auto& s : plot.series) {
    if (s.name.empty()) continue;
    canvas.rect(lx + 6, legend_y + 8, lx + 28, legend_y + 11, s.color);
    canvas.text(lx + 34, legend_y, s.name, kBlack, 2);
    legend_y += 22;
  }
}

// A perceptually ordered colour map (viridis, sampled at 9 points and interpolated).
Color colormap(double t) {
  static const double table[9][3] = {{68, 1, 84},    {71, 44, 122}, {59, 81, 139},  {44, 113, 142}, {33, 144, 141},
                                     {39, 173, 129}, {92, 200, 99}, {170, 220, 50}, {253, 231, 37}};
  t = std::min(1.0, std::max(0.0, std::isfinite(t) ? t : 0.0)) * 8;
  const int i = std::min(7, static_cast<int>(t));
  const double f = t - i;
  Color c;
  for (int k = 0; k < 3; ++k) c[k] = static_cast<unsigned char>(table[i][k] + f * (table[i + 1][k] - table[i][k]));
  return c;
}

}  // namespace

Color series_color(int index) {
  static const Color colors[] = {{31, 119, 180}, {214, 39, 40},   {44, 160, 44},
                                 {255, 127, 14}, {148, 103, 189}, {80, 80, 80}};
  return colors[index % 6];
}

void write_line_plots(const std::string& path, const std::vector<LinePlot>& panels, int panel_width, int panel_height,
                      int columns) {
  const int count = std::max(1, static_cast<int>(panels.size()));
  const int per_row = columns > 0 ? std::min(columns, count) : count;
  const int rows = (count + per_row - 1) / per_row;
  Canvas canvas(panel_width * per_row, panel_height * rows);
  for (int i = 0; i < static_cast<int>(panels.size()); ++i) {
    draw_line_plot(canvas, panels[i], (i % per_row) * panel_width, (i / per_row) * panel_height, panel_width,
                   panel_height);
  }
  canvas.save(path);
}

void write_heatmaps(const std::string& path, const std::string& title, const std::vector<Heatmap>& panels,
                    const std::string& row_label, const std::string& col_label, int columns) {
  const int rows = panels.empty() ? 1 : panels.front().rows;
  const int cols = panels.empty() ? 1 : panels.front().cols;
  const int per_row = columns > 0 ? std::min<int>(columns, static_cast<int>(std::max<size_t>(panels.size(), 1)))
                                  : static_cast<int>(std::max<size_t>(panels.size(), 1));
  const int grid_rows = (static_cast<int>(panels.size()) + per_row - 1) / std::max(per_row, 1);
  const int cell = std::max(4, std::min(48, (grid_rows > 1 ? 240 : 360) / std::max(rows, cols)));
  const int panel_w = cols * cell, panel_h = rows * cell;
  const int gap = 40, left = 60, top = 70, bar_w = 18, row_gap = 70;
  const int width = std::max(left + per_row * (panel_w + gap) + 70, Canvas::text_width(title, 2) + 40);
  const int height = top + std::max(grid_rows, 1) * (panel_h + row_gap) - row_gap + 60;
  Canvas canvas(width, height);
  canvas.text((width - Canvas::text_width(title, 2)) / 2, 10, title, kBlack, 2);
  // Character labels need a cell as wide as a glyph (stb_easy_font: about 6 px).
  const bool show_labels = cell >= 7;
  for (size_t p = 0; p < panels.size(); ++p) {
    const auto& panel = panels[p];
    const int px = left + static_cast<int>(p % per_row) * (panel_w + gap);
    const int py = top + static_cast<int>(p / per_row) * (panel_h + row_gap);
    canvas.text(px + (panel_w - Canvas::text_width(panel.title, 2)) / 2, py - 26, panel.title, kBlack, 2);
    for (int r = 0; r < panel.rows; ++r)
      for (int c = 0; c < panel.cols; ++c)
        canvas.rect(px + c * cell, py + r * cell, px + (c + 1) * cell, py + (r + 1) * cell,
                    colormap(panel.values[static_cast<size_t>(r) * panel.cols + c]));
    // Ticks on both axes: the labels when given and legible, else indices every few rows.
    const bool labelled = show_labels && static_cast<int>(panel.row_labels.size()) == panel.rows &&
                          static_cast<int>(panel.col_labels.size()) == panel.cols;
    const int every = labelled ? 1 : std::max(1, 16 * 1 / cell + (rows > 16 ? rows / 8 : 0));
    for (int r = 0; r < panel.rows; r += every) {
      const auto label = labelled ? panel.row_labels[static_cast<size_t>(r)] : std::to_string(r);
      canvas.text(px - 4 - Canvas::text_width(label), py + r * cell + cell / 2 - 4, label, kBlack);
    }
    for (int c = 0; c < panel.cols; c += every) {
      const auto label = labelled ? panel.col_labels[static_cast<size_t>(c)] : std::to_string(c);
      canvas.text(px + c * cell + cell / 2 - Canvas::text_width(label) / 2, py + panel_h + 4, label, kBlack);
    }
    canvas.text(px + (panel_w - Canvas::text_width(col_label, 2)) / 2, py + panel_h + 18, col_label, kBlack, 2);
    if (p % per_row == 0) canvas.vertical_text(8, py + panel_h / 2, row_label, kBlack, 2);
  }
  // The colour scale.
  const int bx = left + per_row * (panel_w + gap);
  for (int y = 0; y < panel_h; ++y)
    canvas.rect(bx, top + y, bx + bar_w, top + y + 1, colormap(1.0 - double(y) / panel_h));
  for (double t : {0.0, 0.25, 0.5, 0.75, 1.0}) {
    const int y = top + static_cast<int>((1.0 - t) * (panel_h - 1));
    canvas.line(bx + bar_w, y, bx + bar_w + 4, y, kBlack);
    canvas.text(bx + bar_w + 8, y - 4, format_tick(t), kBlack);
  }
  canvas.save(path);
}

}  // namespace qkv_plot

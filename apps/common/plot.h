// PNG figures for qkv's apps: line plots (loss curves, measured curves) and attention heatmaps.
// Pixels are drawn here; text comes from stb_easy_font and the file from stb_image_write.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

namespace qkv_plot {

using Color = std::array<unsigned char, 3>;

struct Series {
  std::string name;
  std::vector<double> x;
  std::vector<double> y;
  Color color;
};

struct LinePlot {
  std::string title;
  std::string x_label;
  std::string y_label;
  std::vector<Series> series;
  bool log_x = false;
  bool log_y = false;
  /// Fixed y range (both set) instead of the data's, e.g. [0, 1] for attention weights.
  std::optional<double> y_min, y_max;
};

/// A matrix shown as a heatmap: rows are queries, columns keys; values in [0, 1].
struct Heatmap {
  std::string title;
  int rows = 0;
  int cols = 0;
  std::vector<float> values;  // row-major, rows * cols
  /// Tick labels (e.g. the characters of a text), shown instead of indices where the cells are
  /// wide enough; one short ASCII string per row / column, or empty.
  std::vector<std::string> row_labels = {}, col_labels = {};
};

/// Colours for up to six series, distinguishable in colour and in grey.
Color series_color(int index);

/// Writes one figure with one or more panels side by side. Throws std::runtime_error naming the
/// path when it cannot be written.
/// `columns` panels per row (0: all in one row).
void write_line_plots(const std::string& path, const std::vector<LinePlot>& panels, int panel_width = 560,
                      int panel_height = 400, int columns = 0);
/// Heatmaps of one size in a grid of `columns` panels per row (0: all in one row), one colour
/// scale (0 to 1) for all, with axis labels.
void write_heatmaps(const std::string& path, const std::string& title, const std::vector<Heatmap>& panels,
                    const std::string& row_label, const std::string& col_label, int columns = 0);

}  // namespace qkv_plot

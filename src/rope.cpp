// Rotary position embedding: each pair (x[i], x[i + D/2]) of a head's query or key is rotated by
// an angle proportional to its position, so that q·k depends on the positions' difference only.
#include "rope.h"
#include "half_precision.h"
#include "torch_compat.h"

#include "kernels/bfloat16_bits.h"
#include "kernels/tiled/operands.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <type_traits>

// at::parallel_for is an inline `#pragma omp parallel` in an OpenMP build of LibTorch: compiled
// without OpenMP it is a loop on one thread (src/CMakeLists.txt gives this file -fopenmp).
#if AT_PARALLEL_OPENMP && defined(QKV_OPENMP_FOUND) && !defined(_OPENMP)
#error "rope.cpp calls at::parallel_for: compile it with OpenMP (src/CMakeLists.txt), or it runs on one thread"
#endif

namespace qkv::detail {

RopeTable rope_table(int64_t offset, int64_t positions, int64_t head_dim, double base, torch::ScalarType dtype,
                     const torch::Device& device) {
  const int64_t half = head_dim / 2;
  const auto f64 = torch::TensorOptions(torch::kDouble).device(device);
  const auto frequencies = torch::pow(base, -torch::arange(half, f64) * (2.0 / static_cast<double>(2 * half)));
  const auto angles =
      torch::arange(offset, offset + positions, f64).unsqueeze(1) * frequencies.unsqueeze(0);  // (P, D/2)
  const auto table_dtype = half_precision(dtype) ? torch::kFloat : dtype;
  return {angles.cos().to(table_dtype), angles.sin().to(table_dtype)};
}

namespace {

// The rotation as LibTorch operations (any device, dtype and rank).
torch::Tensor rotate_by_operations(const torch::Tensor& x, const RopeTable& table) {
  const int64_t half = x.size(-1) / 2;
  const bool reduced = half_precision(x.scalar_type());
  const auto input = reduced ? x.to(torch::kFloat) : x;
  const auto x1 = input.narrow(-1, 0, half);     // (..., N, D/2)
  const auto x2 = input.narrow(-1, half, half);  // (..., N, D/2)
  auto rotated = torch::cat({x1 * table.cos - x2 * table.sin, x2 * table.cos + x1 * table.sin}, /*dim=*/-1);
  return reduced ? rotated.to(x.scalar_type()) : rotated;  // (..., N, D)
}

// One row of the rotation: into = [x1 ⊙ c - s·x2 ⊙ sn, x2 ⊙ c + s·x1 ⊙ sn] for the halves x1, x2 of
// `from`. float32 rows (the module's default) are compiled for AVX-512 and AVX2 as well and the
// CPU picks one at load time (GCC's target_clones); every clone is this loop, only wider (with
// fused multiply-adds where the CPU has them: one rounding less, within float32's tolerance).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// "arch=x86-64-v3" is AVX2 with FMA in one clone ("avx2,fma" would name two), chosen by GCC's
// resolver from the CPU's features (GCC 12 and later).
#define QKV_ROTATE_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define QKV_ROTATE_CLONES
#endif
QKV_ROTATE_CLONES void rotate_float_row(const float* __restrict from, float* __restrict into,
                                        const float* __restrict c, const float* __restrict sn, int64_t half,
                                        float s) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = from[i], x2 = from[i + half], rotated_sin = s * sn[i];
    into[i] = x1 * c[i] - x2 * rotated_sin;
    into[i + half] = x2 * c[i] + x1 * rotated_sin;
  }
}

// The same for a bfloat16 row with a float32 table, on the bits (the rotation in float32, one
// rounding per value): LibTorch's c10::BFloat16 conversions kept this loop scalar, 2.6× slower than
// a float32 row (AMD EPYC Zen 5, 2026-12-03).
QKV_ROTATE_CLONES void rotate_bfloat16_row(const uint16_t* __restrict from, uint16_t* __restrict into,
                                           const float* __restrict c, const float* __restrict sn, int64_t half,
                                           float s) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = kernels::bfloat16_bits_to_float(from[i]), x2 = kernels::bfloat16_bits_to_float(from[i + half]);
    const float rotated_sin = s * sn[i];
    into[i] = kernels::float_to_bfloat16_bits(x1 * c[i] - x2 * rotated_sin);
    into[i + half] = kernels::float_to_bfloat16_bits(x2 * c[i] + x1 * rotated_sin);
  }
}

template <typename scalar_t, typename table_t>
void rotate_row(const scalar_t* from, scalar_t* into, const table_t* c, const table_t* sn, int64_t half, table_t s) {
  if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<table_t, float>) {
    rotate_float_row(from, into, c, sn, half, s);
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<table_t, float>) {
    rotate_bfloat16_row(reinterpret_cast<const uint16_t*>(from), reinterpret_cast<uint16_t*>(into), c, sn, half, s);
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const auto x1 = static_cast<table_t>(from[i]), x2 = static_cast<table_t>(from[i + half]);
      const table_t rotated_sin = s * sn[i];
      into[i] = static_cast<scalar_t>(x1 * c[i] - x2 * rotated_sin);
      into[i + half] = static_cast<scalar_t>(x2 * c[i] + x1 * rotated_sin);
    }
  }
}

// One pass over x (B, H, N, D), unit stride along D: out = [x1 cos - s·x2 sin, x2 cos + s·x1 sin]
// with the sign s = ±1 (-1: the inverse rotation, which is the rotation's transpose), in the
// table's precision (float32 for half types).
torch::Tensor rotate_in_one_pass(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                 double sign) {
  auto out = kernels::tiled::empty_in_layout_of(x, x.size(3), x.options());  // x's layout
  const int64_t B = x.size(0), H = x.size(1), N = x.size(2), half = x.size(3) / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qkv_rope", [&] {
    using table_t = at::opmath_type<scalar_t>;
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* to = out.data_ptr<scalar_t>();
    const table_t* cos_rows = cos.data_ptr<table_t>();
    const table_t* sin_rows = sin.data_ptr<table_t>();
    const auto in_strides = x.strides(), out_strides = out.strides();
    const table_t s = static_cast<table_t>(sign);
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(2 * half, 1));
    at::parallel_for(0, B * H * N, grain, [&](int64_t begin, int64_t end) {
      // The chunk's first row as (b, h, n), then stepped: no divisions per row (they cost as much
      // as a row of 16 pairs).
      int64_t n = begin % N, h = (begin / N) % H, b = begin / (N * H);
      for (int64_t row = begin; row < end; ++row) {
        rotate_row(in + b * in_strides[0] + h * in_strides[1] + n * in_strides[2],
                   to + b * out_strides[0] + h * out_strides[1] + n * out_strides[2], cos_rows + n * half,
                   sin_rows + n * half, half, s);
        if (++n == N) {
          n = 0;
          if (++h == H) h = 0, ++b;
        }
      }
    });
  });
  return out;
}

// The one-pass rotation for autograd: its gradient is the inverse rotation of the upstream
// gradient, itself this function, so gradients of gradients are recorded too.
class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& cos,
                               const torch::Tensor& sin, double sign) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["sign"] = sign;
    return rotate_in_one_pass(x, cos, sin, sign);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const double sign = ctx->saved_data["sign"].toDouble();
    auto grad = grad_outputs[0];
    if (grad.stride(-1) != 1) grad = grad.contiguous();
    return {compat::apply_autograd_function<RotaryFunction>(grad, saved[0], saved[1], -sign), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor apply_rope(const torch::Tensor& x, const RopeTable& table) {
  // The one-pass kernel on the CPU for (B, H, N, D) with unit stride along D and a table of one
  // row per position in its precision; anything else by LibTorch operations.
  const auto table_type = half_precision(x.scalar_type()) ? torch::kFloat : x.scalar_type();
  const bool one_pass = x.device().is_cpu() && x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0 &&
                        table.cos.scalar_type() == table_type && table.sin.scalar_type() == table_type &&
                        table.cos.dim() == 2 && table.cos.size(0) == x.size(2) && table.cos.size(1) == x.size(3) / 2 &&
                        table.sin.sizes() == table.cos.sizes() && !table.cos.requires_grad() &&
                        !table.sin.requires_grad();
  if (!one_pass) return rotate_by_operations(x, table);
  return compat::apply_autograd_function<RotaryFunction>(x, table.cos.contiguous(), table.sin.contiguous(), 1.0);
}

torch::Tensor apply_rope(const torch::Tensor& x, int64_t offset, double base) {
  return apply_rope(x, rope_table(offset, x.size(-2), x.size(-1), base, x.scalar_type(), x.device()));
}

}  // namespace qkv::detail

// scaled_dot_product_attention: argument checks and the choice of backend. The backends
// themselves live in src/kernels/, one file each; the math one is the reference.
//
// B = batch, H = query heads, Hkv = key/value heads, N = query positions, S = key positions,
// D = head width, Dv = value width.
#include <qkv/functional.h>

#include "kernels/kernels.h"
#include "mask_algebra.h"
#include "kernels/linear/onednn_gemm.h"
#include "linear.h"
#include "kernels/tiled/blocks.h"
#include "kernels/tiled/cpu_features.h"
#include "kernels/tiled/tiled_cpu.h"
#include "torch_compat.h"

#include <torch/torch.h>

#include <cmath>

namespace qkv {

const char* to_string(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::Auto:
      return "auto";
    case AttentionBackend::Math:
      return "math";
    case AttentionBackend::Fused:
      return "fused";
    case AttentionBackend::Tiled:
      return "tiled";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& stream, AttentionBackend backend) { return stream << to_string(backend); }

bool fused_backend_available() { return QKV_TORCH_HAS_SDPA != 0; }

namespace {

const char* defined_text(const torch::Tensor& t) { return t.defined() ? "defined" : "undefined"; }

void check_shapes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  const ScaledDotProductAttentionOptions& options) {
  TORCH_CHECK(q.defined() && k.defined() && v.defined(),
              "scaled_dot_product_attention: expected defined tensors q, k and v, got q ", defined_text(q), ", k ",
              defined_text(k), ", v ", defined_text(v));
  TORCH_CHECK(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim(),
              "scaled_dot_product_attention: expected q (..., N, D), k (..., S, D) and v (..., S, Dv) of the same "
              "rank >= 2, got q ",
              q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(k.sizes().slice(0, k.dim() - 2) == v.sizes().slice(0, v.dim() - 2),
              "scaled_dot_product_attention: expected k and v with equal leading (batch, head) dimensions, got k ",
              k.sizes(), ", v ", v.sizes());
  const auto leading = q.dim() - 2;
  if (options.enable_gqa() && q.dim() >= 3) {
    // Everything but the head dimension (-3) must match; k's heads must divide q's.
    const auto q_heads = q.size(-3), kv_heads = k.size(-3);
    TORCH_CHECK(
        q.sizes().slice(0, leading - 1) == k.sizes().slice(0, leading - 1) && kv_heads > 0 && q_heads % kv_heads == 0,
        "scaled_dot_product_attention: with enable_gqa, expected q (..., H, N, D) and k, v (..., Hkv, S, D) "
        "with equal batch dimensions and Hkv dividing H, got q ",
        q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  } else {
    TORCH_CHECK(q.sizes().slice(0, leading) == k.sizes().slice(0, leading),
                "scaled_dot_product_attention: expected equal leading (batch, head) dimensions, got q ", q.sizes(),
                ", k ", k.sizes(), ", v ", v.sizes(),
                q.dim() >= 3 && k.size(-3) != q.size(-3) ? " (fewer key/value heads need enable_gqa)" : "");
  }
  TORCH_CHECK(q.size(-1) == k.size(-1), "scaled_dot_product_attention: expected q and k of the same width D, got q ",
              q.sizes(), " and k ", k.sizes());
  TORCH_CHECK(k.size(-2) == v.size(-2),
              "scaled_dot_product_attention: expected k and v with the same number of positions S, got k ", k.sizes(),
              " and v ", v.sizes());
}

void check_attention_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const ScaledDotProductAttentionOptions& options) {
  check_shapes(q, k, v, options);
  TORCH_CHECK(at::isFloatingType(q.scalar_type()),
              "scaled_dot_product_attention: expected floating-point q, k, v, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "scaled_dot_product_attention: expected q, k and v of one dtype, got q ", q.scalar_type(), ", k ",
              k.scalar_type(), ", v ", v.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(),
              "scaled_dot_product_attention: expected q, k and v on one device, got q on ", q.device(), ", k on ",
              k.device(), ", v on ", v.device());
  if (options.window()) {
    TORCH_CHECK(*options.window() >= 1, "scaled_dot_product_attention: expected a window of at least 1 key, got ",
                *options.window());
    TORCH_CHECK(options.causal(),
                "scaled_dot_product_attention: a sliding window (query i attends to keys i - W + 1 ... i) needs "
                "causal(true)");
  }
  TORCH_CHECK(options.dropout() >= 0.0 && options.dropout() < 1.0,
              "scaled_dot_product_attention: expected dropout in [0, 1), got ", options.dropout());
  if (options.scale()) {
    TORCH_CHECK(std::isfinite(*options.scale()), "scaled_dot_product_attention: expected a finite scale, got ",
                *options.scale());
  }
  const auto& mask = options.mask();
  if (mask.defined()) {
    TORCH_CHECK(mask.scalar_type() == torch::kBool || at::isFloatingType(mask.scalar_type()),
                "scaled_dot_product_attention: expected a bool mask (true = attend) or a floating mask (added to "
                "the scores), got ",
                mask.scalar_type());
    TORCH_CHECK(mask.device() == q.device(), "scaled_dot_product_attention: expected the mask on ", q.device(),
                " like q, got ", mask.device());
    // The scores have shape (..., N, S); the mask must broadcast to it.
    auto scores_shape = q.sizes().vec();
    scores_shape.back() = k.size(-2);
    bool broadcastable = mask.dim() <= static_cast<int64_t>(scores_shape.size());
    for (int64_t i = 1; broadcastable && i <= mask.dim(); ++i) {
      const auto m = mask.size(-i);
      broadcastable = m == 1 || m == scores_shape[scores_shape.size() - i];
    }
    TORCH_CHECK(broadcastable, "scaled_dot_product_attention: expected a mask broadcastable to the scores' shape ",
                c10::IntArrayRef(scores_shape), " (..., N, S), got ", mask.sizes());
  }
  const auto& lengths = options.key_lengths();
  if (lengths.defined()) {
    TORCH_CHECK(q.dim() == 4 && lengths.dim() == 1 && lengths.size(0) == q.size(0),
                "scaled_dot_product_attention: expected key_lengths of shape (B,) for q (B, H, N, D), got key_lengths ",
                lengths.sizes(), " and q ", q.sizes());
    TORCH_CHECK(!lengths.is_floating_point() && !lengths.is_complex() && lengths.scalar_type() != torch::kBool,
                "scaled_dot_product_attention: expected integer key_lengths, got ", lengths.scalar_type());
    TORCH_CHECK(lengths.device() == q.device(), "scaled_dot_product_attention: expected key_lengths on ", q.device(),
                ", got ", lengths.device());
    // As SelfAttention's: a length past the keys or below 0 is a mistake, not a request to clamp.
    detail::check_key_length_values(lengths, k.size(-2), "scaled_dot_product_attention");
  }
  if (options.backend() == AttentionBackend::Tiled) {
    TORCH_CHECK(!options.need_weights(),
                "scaled_dot_product_attention: the tiled backend cannot return the attention "
                "weights; use AttentionBackend::Auto or Math with need_weights");
    TORCH_CHECK(kernels::tiled_supports(q),
                "scaled_dot_product_attention: the tiled backend runs on the CPU in "
                "float32, float64, bfloat16 or float16, got ",
                q.scalar_type(), " on ", q.device());
  }
  if (options.backend() == AttentionBackend::Fused) {
    TORCH_CHECK(fused_backend_available(),
                "scaled_dot_product_attention: the fused backend needs LibTorch >= 2.0, "
                "this build has ",
                TORCH_VERSION, "; use AttentionBackend::Auto or Math");
    TORCH_CHECK(!options.need_weights(),
                "scaled_dot_product_attention: the fused backend cannot return the "
                "attention weights; use AttentionBackend::Auto or Math with need_weights");
  }
}

}  // namespace

namespace {

// Auto's choice, from the tensors' metadata and whether a gradient will be asked of the call.
// The table, in order (PyTorch's sdp_utils in miniature): each backend's contract is met by every
// input that reaches it (the tiled kernel normalises layouts itself, src/kernels/tiled/operands.cpp).
AttentionBackend auto_backend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const ScaledDotProductAttentionOptions& options) {
  // Only the math path returns weights. Empty inputs go to it too (values of width 0 included):
  // some fused kernels reject zero-sized launches, and there is nothing to compute.
  if (options.need_weights() || q.numel() == 0 || k.numel() == 0 || v.numel() == 0) return AttentionBackend::Math;
  if (kernels::tiled_supports(q) && kernels::tiled_fast_for(q)) {
    // Faster than the math path at every size from N = 4 to 4096, forward and backward, on the
    // 2-core development machine (docs/PERFORMANCE.md, "Choosing the CPU backend"); a decoded
    // token too (one query row at inference, which the kernel takes by dot products, packing
    // nothing): 2-4x the math path, 9-13x LibTorch 2.14's fused CPU kernel in bfloat16 and
    // float16, and in float32 faster than it at 128 keys, 0.9x at 1024-4096 (docs/PERFORMANCE.md,
    // "float16 on the CPU, and decoded tokens by dot products"). With gradients the tiled kernel
    // (unlike LibTorch's fused CPU kernel) also gives second-order gradients.
    return AttentionBackend::Tiled;
  }
  return fused_backend_available() ? AttentionBackend::Fused : AttentionBackend::Math;
}

}  // namespace

AttentionBackend choose_backend(const torch::Tensor& q, const torch::Tensor& k,
                                const ScaledDotProductAttentionOptions& options) {
  if (options.backend() != AttentionBackend::Auto) return options.backend();
  return auto_backend(q, k, k, options);
}

AttentionResult scaled_dot_product_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                             const ScaledDotProductAttentionOptions& given) {
  check_attention_inputs(q, k, v, given);
  // Key lengths of any integer dtype (int32 from a tokenizer, say) reach the backends as int64.
  const bool convert_lengths = given.key_lengths().defined() && given.key_lengths().scalar_type() != torch::kLong;
  ScaledDotProductAttentionOptions converted;
  if (convert_lengths) {
    converted = ScaledDotProductAttentionOptions(given).key_lengths(given.key_lengths().to(torch::kLong));
  }
  const auto& options = convert_lengths ? converted : given;
  const auto backend = options.backend() != AttentionBackend::Auto ? options.backend() : auto_backend(q, k, v, options);
  switch (backend) {
    case AttentionBackend::Fused:
      return kernels::fused_attention(q, k, v, options);
    case AttentionBackend::Tiled:
      return kernels::tiled_attention(q, k, v, options);
    default:
      return kernels::math_attention(q, k, v, options);
  }
}

std::string tiled_instruction_set() { return kernels::tiled::isa_name(kernels::tiled::active_isa()); }

std::string blas_core() { return kernels::tiled::blas_core(); }

std::string linear_products() {
  const auto& gemm = kernels::linear::OneDnnGemm::instance();
  std::string float32;
  switch (detail::float32_products()) {
    case detail::Float32Products::OneDnn: float32 = gemm.name(); break;
    case detail::Float32Products::MicroKernels:
      float32 = "qkv's float32 micro-kernels (" + gemm.float32_unavailable_because() + ")";
      break;
    case detail::Float32Products::LibTorch:
      float32 = "LibTorch's (" + gemm.float32_unavailable_because() +
                (kernels::linear::linear_gemm_choice() == kernels::linear::LinearGemmChoice::LibTorch
                     ? ""
                     : "; qkv's micro-kernels are plain C++ here") +
                ")";
      break;
  }
  const bool float32_on_onednn = detail::float32_products() == detail::Float32Products::OneDnn;
  switch (detail::bfloat16_products()) {
    case detail::Bfloat16Products::OneDnnBfloat16:
      return float32 + (float32_on_onednn ? " (bfloat16 autocast too)"
                                       : "; bfloat16 autocast on " + gemm.name() + "'s bfloat16 GEMM");
    case detail::Bfloat16Products::Float32:
      return float32 + (float32_on_onednn ? " (bfloat16 autocast too, on qkv's float32 micro-kernels: no bfloat16 "
                                            "instructions)"
                                          : "; bfloat16 autocast on qkv's float32 micro-kernels (no bfloat16 "
                                            "instructions)");
    case detail::Bfloat16Products::LibTorch: break;
  }
  return float32;
}

std::string blas_core_advice() { return kernels::tiled::blas_core_advice(); }

}  // namespace qkv

// qkv::checkpoint: an autograd::Function whose forward runs the function without autograd and
// whose backward runs it again with autograd, replaying the random draws, and differentiates it.
//
// The function travels to the backward in a capsule of the autograd context (saved_data holds
// IValues only); the inputs go through save_for_backward, so modifying one in place before the
// backward is refused by autograd, as for any saved tensor.
#include <qkv/checkpoint.h>

#include "kernels/kernels.h"
#include "torch_compat.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

namespace qkv {
namespace {

// The generators a function's random draws come from: the CPU's, and the inputs' device's when
// that is another (CUDA's philox offsets for dropout on the GPU).
std::vector<at::Generator> generators_of(const std::vector<torch::Tensor>& inputs) {
  std::vector<at::Generator> generators{at::detail::getDefaultCPUGenerator()};
  for (const auto& input : inputs) {
    if (input.defined() && !input.device().is_cpu()) {
      generators.push_back(at::globalContext().defaultGenerator(input.device()));
      break;
    }
  }
  return generators;
}

std::vector<torch::Tensor> states_of(std::vector<at::Generator>& generators) {
  std::vector<torch::Tensor> states;
  for (auto& generator : generators) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    states.push_back(generator.get_state());
  }
  return states;
}

void set_states(std::vector<at::Generator>& generators, const std::vector<torch::Tensor>& states) {
  for (size_t i = 0; i < generators.size(); ++i) {
    std::lock_guard<std::mutex> lock(generators[i].mutex());
    generators[i].set_state(states[i]);
  }
}

// Autocast's state on the CPU and CUDA (enabled, dtype): the recomputation must run in the
// precision the forward ran in, as torch.utils.checkpoint re-enters the forward's autocast.
struct AutocastState {
  bool cpu_enabled = false, cuda_enabled = false;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;

  static AutocastState current() {
    return {compat::autocast_enabled(at::kCPU), compat::autocast_enabled(at::kCUDA),
            compat::autocast_dtype(at::kCPU), compat::autocast_dtype(at::kCUDA)};
  }
  void apply() const {
    compat::set_autocast_enabled(at::kCPU, cpu_enabled);
    compat::set_autocast_dtype(at::kCPU, cpu_dtype);
    compat::set_autocast_enabled(at::kCUDA, cuda_enabled);
    compat::set_autocast_dtype(at::kCUDA, cuda_dtype);
  }
};

// Autocast's cache of casts off for a scope. LibTorch's autocast keeps the casts of float32 weights
// (leaves that require grad) until the outermost autocast scope ends (Apex's heuristic). A cast made
// by the checkpoint's forward, which runs without autograd, has no history: reused later in the
// scope (by the recomputation, or by code that reads the weight again after the checkpoint) it cut
// the weight off from its gradient (ActivationCheckpointing.UnderAutocast... in
// tests/test_long_sequences.cpp). Neither run caches, then; a weight the function reads twice is
// cast twice.
class AutocastCacheOff {
 public:
  AutocastCacheOff() : previous_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~AutocastCacheOff() { at::autocast::set_autocast_cache_enabled(previous_); }
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  bool previous_;
};

// What the backward needs besides the saved tensors.
struct Recipe : torch::CustomClassHolder {
  CheckpointedFunction function;
  std::vector<at::Generator> generators;
  std::vector<torch::Tensor> rng_states;  // before the forward's run
  AutocastState autocast;                 // during the forward's run
  size_t input_count = 0;
};

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // inputs then parameters, each a variable of the autograd graph; the backward returns one
  // gradient per variable, in that order, and none for the recipe.
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs, at::TensorList parameters,
                               const c10::intrusive_ptr<Recipe>& recipe) {
    std::vector<torch::Tensor> saved(inputs.begin(), inputs.end());
    saved.insert(saved.end(), parameters.begin(), parameters.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["recipe"] = c10::IValue::make_capsule(recipe);
    const AutocastCacheOff no_cached_casts;
    const kernels::RecomputedLater recomputed_later;  // the backward's second run must give the same output
    return recipe->function(std::vector<torch::Tensor>(inputs.begin(), inputs.end()));  // autograd is off here
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_outputs) {
    auto recipe = c10::static_intrusive_pointer_cast<Recipe>(ctx->saved_data["recipe"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    const bool create_graph = torch::GradMode::is_enabled();
    // The inputs of the second run: detached copies (so its graph ends at them), or, when the
    // gradients must themselves be differentiable (create_graph), the saved inputs with their history.
    std::vector<torch::Tensor> inputs;
    for (size_t i = 0; i < recipe->input_count; ++i) {
      const auto& input = saved[i];
      const bool detach = input.defined() && !create_graph;
      inputs.push_back(detach ? input.detach().requires_grad_(input.requires_grad()) : input);
    }
    torch::Tensor output;
    {
      // The forward's random draws and precision, replayed; the current ones put back after.
      const auto current = states_of(recipe->generators);
      const auto current_autocast = AutocastState::current();
      set_states(recipe->generators, recipe->rng_states);
      recipe->autocast.apply();
      struct Restore {
        Recipe& recipe;
        const std::vector<torch::Tensor>& states;
        const AutocastState& autocast;
        ~Restore() {
          set_states(recipe.generators, states);
          autocast.apply();
        }
      } restore{*recipe, current, current_autocast};
      const AutocastCacheOff no_cached_casts;
      torch::AutoGradMode enable(true);
      output = recipe->function(inputs);
    }
    // The gradient of every saved variable that requires one.
    std::vector<torch::Tensor> wrt;
    std::vector<size_t> which;
    for (size_t i = 0; i < saved.size(); ++i) {
      const auto& variable = i < recipe->input_count ? inputs[i] : saved[i];
      if (variable.defined() && variable.requires_grad() && ctx->needs_input_grad(i)) {
        wrt.push_back(variable), which.push_back(i);
      }
    }
    torch::autograd::tensor_list grads(saved.size() + 1);  // + the recipe's (none)
    if (wrt.empty() || !output.requires_grad()) return grads;
    const auto computed = torch::autograd::grad({output}, wrt, {grad_outputs[0]}, /*retain_graph=*/create_graph,
                                                create_graph, /*allow_unused=*/true);
    for (size_t i = 0; i < which.size(); ++i) grads[which[i]] = computed[i];
    return grads;
  }
};

}  // namespace

torch::Tensor checkpoint(const CheckpointedFunction& function, const std::vector<torch::Tensor>& inputs,
                         const std::vector<torch::Tensor>& parameters) {
  TORCH_CHECK(static_cast<bool>(function), "qkv::checkpoint: expected a function to run, got an empty one");
  bool wants_grad = false;
  for (const auto* list : {&inputs, &parameters}) {
    for (const auto& t : *list) wants_grad = wants_grad || (t.defined() && t.requires_grad());
  }
  if (!torch::GradMode::is_enabled() || !wants_grad) return function(inputs);
  auto recipe = c10::make_intrusive<Recipe>();
  recipe->function = function;
  recipe->generators = generators_of(inputs);
  recipe->rng_states = states_of(recipe->generators);
  recipe->autocast = AutocastState::current();
  recipe->input_count = inputs.size();
  return compat::apply_autograd_function<CheckpointFunction>(at::TensorList(inputs), at::TensorList(parameters),
                                                             recipe);
}

}  // namespace qkv

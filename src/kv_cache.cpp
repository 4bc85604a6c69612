// KVCache: preallocated keys and values, appended to in place; a rolling cache writes position p
// into slot p mod capacity.
#include <qkv/kv_cache.h>

#include <torch/torch.h>

namespace qkv {

namespace {

void check_geometry(int64_t batch, int64_t kv_heads, int64_t capacity, int64_t head_dim, int64_t value_dim,
                    const torch::TensorOptions& options) {
  TORCH_CHECK(batch >= 1 && kv_heads >= 1 && capacity >= 1 && head_dim >= 1 && value_dim >= 1,
              "KVCache: expected batch, kv_heads, capacity, head_dim and value_dim >= 1, got batch ", batch,
              ", kv_heads ", kv_heads, ", capacity ", capacity, ", head_dim ", head_dim, ", value_dim ", value_dim);
  TORCH_CHECK(at::isFloatingType(c10::typeMetaToScalarType(options.dtype())),
              "KVCache: expected a floating-point dtype, got ", options.dtype());
}

}  // namespace

KVCache::KVCache(int64_t batch, int64_t kv_heads, int64_t capacity, int64_t head_dim, int64_t value_dim,
                 const torch::TensorOptions& options) {
  check_geometry(batch, kv_heads, capacity, head_dim, value_dim, options);
  keys_ = torch::zeros({batch, kv_heads, capacity, head_dim}, options.requires_grad(false));
  values_ = torch::zeros({batch, kv_heads, capacity, value_dim}, options.requires_grad(false));
}

KVCache KVCache::rolling(int64_t batch, int64_t kv_heads, int64_t window, int64_t head_dim, int64_t value_dim,
                         const torch::TensorOptions& options) {
  KVCache cache(batch, kv_heads, window, head_dim, value_dim, options);
  cache.window_ = window;
  return cache;
}

KVCache KVCache::clone() const {
  KVCache copy;
  copy.keys_ = keys_.clone(), copy.values_ = values_.clone();
  copy.length_ = length_;
  copy.rope_base_ = rope_base_;
  copy.window_ = window_;
  copy.rope_cos_ = rope_cos_, copy.rope_sin_ = rope_sin_;  // never written after make_cache: shared
  return copy;
}

void KVCache::truncate(int64_t length) {
  TORCH_CHECK(length >= 0 && length <= length_, "KVCache::truncate: expected a length in [0, ", length_,
              "] (the positions seen), got ", length);
  TORCH_CHECK(!rolling() || length_ <= capacity() || length == length_,
              "KVCache::truncate: this rolling cache has seen ", length_, " positions and holds only the last ",
              capacity(), "; the positions before them, which position ", length,
              "'s window would need, are overwritten (reset() it and decode again)");
  length_ = length;
}

torch::Tensor KVCache::chronological(const torch::Tensor& storage, int64_t first) const {
  const int64_t count = length_ - first;
  const int64_t start = first % capacity();
  if (start + count <= capacity()) return storage.narrow(/*dim=*/2, start, count);
  const int64_t tail = capacity() - start;
  return torch::cat({storage.narrow(2, start, tail), storage.narrow(2, 0, count - tail)}, /*dim=*/2);
}

torch::Tensor KVCache::keys() const { return chronological(keys_, length_ - held()); }

torch::Tensor KVCache::values() const { return chronological(values_, length_ - held()); }

void KVCache::check_append(const char* caller, int64_t batch, int64_t new_positions, torch::ScalarType dtype,
                           const torch::Device& device) const {
  TORCH_CHECK(batch == batch_size(), caller, ": the KVCache was made for a batch of ", batch_size(),
              " sequences, got a batch of ", batch, "; make a cache with make_cache(", batch, ", capacity)");
  TORCH_CHECK(dtype == this->dtype(), caller, ": the KVCache holds ", this->dtype(), ", got input of dtype ", dtype,
              "; make the cache after converting the module with .to(), and inside the same autocast scope");
  TORCH_CHECK(device == this->device(), caller, ": the KVCache is on ", this->device(), ", got input on ", device,
              "; make the cache after moving the module with .to()");
  TORCH_CHECK(rolling() || new_positions <= capacity() - length_, caller, ": the KVCache holds ", length_, " of its ",
              capacity(), " positions; ", new_positions,
              " more would overflow it (reset() it, or make a larger one with "
              "make_cache(batch, capacity))");
}

void KVCache::write(const torch::Tensor& keys, const torch::Tensor& values) {
  // The storage never joins an autograd graph: the cache is for inference.
  torch::NoGradGuard no_grad;
  const int64_t added = keys.size(2);
  // Only the last capacity() new positions can be held; they go to their slots, wrapping once at most.
  const int64_t kept = std::min(added, capacity());
  int64_t position = length_ + added - kept, source = added - kept;
  while (source < added) {
    const int64_t slot = position % capacity();
    const int64_t run = std::min(added - source, capacity() - slot);
    keys_.narrow(2, slot, run).copy_(keys.narrow(2, source, run));
    values_.narrow(2, slot, run).copy_(values.narrow(2, source, run));
    position += run, source += run;
  }
  length_ += added;
}

std::pair<torch::Tensor, torch::Tensor> KVCache::append(const torch::Tensor& keys, const torch::Tensor& values) {
  TORCH_CHECK(keys.defined() && values.defined() && keys.dim() == 4 && values.dim() == 4,
              "KVCache::append: expected keys (B, Hkv, T, D) and values (B, Hkv, T, Dv)");
  check_append("KVCache::append", keys.size(0), keys.size(2), keys.scalar_type(), keys.device());
  TORCH_CHECK(keys.size(1) == kv_heads() && keys.size(3) == head_dim() &&
                  values.sizes().slice(0, 3) == keys.sizes().slice(0, 3) && values.size(3) == value_dim() &&
                  values.scalar_type() == dtype() && values.device() == device(),
              "KVCache::append: expected keys (B, ", kv_heads(), ", T, ", head_dim(), ") and values (B, ", kv_heads(),
              ", T, ", value_dim(), ") of ", dtype(), " on ", device(), ", got keys ", keys.sizes(), " and values ",
              values.sizes());
  write(keys, values);
  return {this->keys(), this->values()};
}

}  // namespace qkv

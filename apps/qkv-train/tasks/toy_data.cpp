#include "tasks/toy_data.h"

#include <ATen/CPUGeneratorImpl.h>

namespace qkv_train {

// Every batch comes from its own generator, seeded by (seed, step).
at::Generator batch_generator(uint64_t seed, int64_t step) {
  const uint64_t mixed = seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(step) * 0xBF58476D1CE4E5B9ULL + 1;
  return at::make_generator<at::CPUGeneratorImpl>(mixed);
}

namespace {

class ReverseData : public ToyData {
 public:
  ReverseData(uint64_t seed, int64_t seq_len, int64_t d_model, torch::Device device, torch::ScalarType dtype)
      : seed_(seed), n_(seq_len), content_(d_model - seq_len), device_(device), dtype_(dtype) {}

  ToyBatch sample(int64_t size, int64_t step) const override {
    auto generator = batch_generator(seed_, step);
    auto content = at::randn({size, n_, content_}, generator);           // (B, N, C)
    auto position = torch::eye(n_).unsqueeze(0).expand({size, n_, n_});  // (B, N, N)
    ToyBatch batch;
    batch.input = torch::cat({content, position}, /*dim=*/-1).to(device_, dtype_);  // (B, N, E)
    batch.target = torch::cat({content.flip(1), torch::zeros({size, n_, n_})}, -1).to(device_);
    batch.answer = torch::arange(n_ - 1, -1, -1, torch::kLong).to(device_);  // (N,): N-1-i
    return batch;
  }

  torch::Tensor loss(const torch::Tensor& output, const ToyBatch& batch) const override {
    return torch::mse_loss(output.to(torch::kFloat), batch.target);
  }

  torch::Tensor answer_weight(const torch::Tensor& weights, const ToyBatch& batch) const override {
    // weights (B, H, N, N): entry [i, N-1-i] of each row.
    return weights.to(torch::kFloat).flip(-1).diagonal(0, -2, -1).mean();
  }

  std::string metric_name() const override { return "mirror_weight"; }

 private:
  uint64_t seed_;
  int64_t n_, content_;
  torch::Device device_;
  torch::ScalarType dtype_;
};

class LookupData : public ToyData {
 public:
  LookupData(uint64_t seed, int64_t seq_len, int64_t d_model, torch::Device device, torch::ScalarType dtype)
      : seed_(seed),
        items_(seq_len - 1),
        key_dim_((d_model - 1) / 2),
        value_dim_(d_model - 1 - key_dim_),
        device_(device),
        dtype_(dtype) {}

  ToyBatch sample(int64_t size, int64_t step) const override {
    auto generator = batch_generator(seed_, step);
    auto keys = at::randn({size, items_, key_dim_}, generator);                              // (B, I, K)
    auto values = at::randn({size, items_, value_dim_}, generator);                          // (B, I, V)
    auto chosen = at::randint(items_, {size}, generator, torch::kLong);                      // (B,)
    auto query_key = keys.gather(1, chosen.view({size, 1, 1}).expand({size, 1, key_dim_}));  // (B, 1, K)
    auto items = torch::cat({keys, values, torch::zeros({size, items_, 1})}, -1);            // (B, I, E)
    auto query = torch::cat({query_key, torch::zeros({size, 1, value_dim_}), torch::ones({size, 1, 1})}, -1);
    ToyBatch batch;
    batch.input = torch::cat({items, query}, 1).to(device_, dtype_);  // (B, N = I + 1, E)
    batch.target = values.gather(1, chosen.view({size, 1, 1}).expand({size, 1, value_dim_})).squeeze(1).to(device_);
    batch.answer = chosen.to(device_);  // (B,): the item the query row should attend to
    return batch;
  }

  torch::Tensor loss(const torch::Tensor& output, const ToyBatch& batch) const override {
    // Only the query row answers: its value slice must be the stored value.
    auto answer = output.select(1, -1).narrow(-1, key_dim_, value_dim_).to(torch::kFloat);  // (B, V)
    return torch::mse_loss(answer, batch.target);
  }

  torch::Tensor answer_weight(const torch::Tensor& weights, const ToyBatch& batch) const override {
    auto query_row = weights.select(-2, -1).to(torch::kFloat);  // (B, H, S)
    const auto heads = query_row.size(1);
    auto index = batch.answer.view({-1, 1, 1}).expand({query_row.size(0), heads, 1});
    return query_row.gather(-1, index).mean();
  }

  std::string metric_name() const override { return "match_weight"; }

 private:
  uint64_t seed_;
  int64_t items_, key_dim_, value_dim_;
  torch::Device device_;
  torch::ScalarType dtype_;
};

}  // namespace

std::unique_ptr<ToyData> make_reverse_data(uint64_t seed, int64_t seq_len, int64_t d_model, const torch::Device& device,
                                           torch::ScalarType dtype) {
  return std::make_unique<ReverseData>(seed, seq_len, d_model, device, dtype);
}

std::unique_ptr<ToyData> make_lookup_data(uint64_t seed, int64_t seq_len, int64_t d_model, const torch::Device& device,
                                          torch::ScalarType dtype) {
  return std::make_unique<LookupData>(seed, seq_len, d_model, device, dtype);
}

}  // namespace qkv_train

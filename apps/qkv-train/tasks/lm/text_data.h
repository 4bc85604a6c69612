// The language model's data: a UTF-8 text, its characters as the vocabulary, train/validation
// split, and the batches of each step.
//
// Character level: the vocabulary is the set of Unicode code points the text contains, sorted,
// so every valid UTF-8 file round-trips exactly through encode and decode.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace qkv_train::lm {

/// A --data file that cannot be trained on (missing, empty, not UTF-8 text); exit status 2.
class DataError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Where the default text lives: Debian's dict-devil package (scripts/setup.sh installs it).
constexpr const char* kDefaultText = "/usr/share/dictd/devil.dict.dz";

/// The text of `path`: a dictd database (.dict.dz with its .index beside it) yields its entries,
/// without the database's own header entries; any other file is read as it is. Checks that it
/// is non-empty valid UTF-8 without NUL bytes. Throws DataError naming the file.
std::string read_text(const std::string& path);

/// Code points of UTF-8 `text`; throws DataError (naming `what` and the byte offset) when invalid.
std::u32string decode_utf8(const std::string& text, const std::string& what);
std::string encode_utf8(const std::u32string& text);

/// The prompt a sample starts from when none is given: a newline (the start of a paragraph) when
/// the text has one, else the text's first character.
std::u32string default_prompt(const std::u32string& text);

/// Characters <-> token ids.
class CharTokenizer {
 public:
  /// The sorted distinct characters of `text`.
  explicit CharTokenizer(const std::u32string& text);
  int64_t size() const { return static_cast<int64_t>(characters_.size()); }
  const std::u32string& characters() const { return characters_; }

  /// int64 (L,) ids of `text`; throws DataError listing characters outside the vocabulary.
  torch::Tensor encode(const std::u32string& text, const std::string& what) const;
  std::string decode(const torch::Tensor& ids) const;
  /// One character as printable ASCII for pictures: itself, '_' for space, '/' for a newline, '?' otherwise.
  char label(int64_t id) const;

 private:
  std::u32string characters_;
};

/// The text, tokenized and split: the last 10% of the characters are the validation set.
struct TextData {
  std::string source;  // the file
  std::u32string text;
  CharTokenizer tokenizer;
  torch::Tensor train;       // int64 (L_train,)
  torch::Tensor validation;  // int64 (L_val,)

  static TextData load(const std::string& path, int64_t context);

  /// Inputs and targets (the inputs shifted by one) of the training batch of `step`: `batch`
  /// windows of `context` ids at offsets drawn from batch_generator(seed, step). (B, N) each.
  std::pair<torch::Tensor, torch::Tensor> training_batch(uint64_t seed, int64_t step, int64_t batch,
                                                         int64_t context) const;
  /// Non-overlapping windows covering the validation set (at most `max_windows`): inputs and targets.
  std::pair<torch::Tensor, torch::Tensor> validation_windows(int64_t context, int64_t max_windows) const;
};

/// Validation loss (nats per predicted character) of the character-bigram model counted on the
/// training set, with add-one smoothing (no bigram of the validation set is impossible), over the
/// same predictions as validation_windows' targets.
double bigram_loss(const TextData& data, const torch::Tensor& inputs, const torch::Tensor& targets);

}  // namespace qkv_train::lm

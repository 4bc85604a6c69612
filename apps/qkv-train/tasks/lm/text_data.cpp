#include "tasks/lm/text_data.h"

#include "tasks/toy_data.h"

#if defined(QKV_HAVE_ZLIB)
#include <zlib.h>
#endif

#include <algorithm>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <sstream>

namespace qkv_train::lm {
namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw DataError("--data " + path + ": cannot open it");
  std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (file.bad()) throw DataError("--data " + path + ": cannot read it");
  return bytes;
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string gunzip(const std::string& path) {
#if defined(QKV_HAVE_ZLIB)
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) throw DataError("--data " + path + ": cannot open it");
  std::string text;
  char buffer[1 << 16];
  int n = 0;
  while ((n = gzread(file, buffer, sizeof(buffer))) > 0) text.append(buffer, static_cast<size_t>(n));
  int error = 0;
  const std::string message = n < 0 ? gzerror(file, &error) : "";
  gzclose(file);
  if (n < 0) throw DataError("--data " + path + ": not a readable gzip file (" + message + ")");
  return text;
#else
  throw DataError("--data " + path + ": this qkv-train was built without zlib and cannot read .dz files");
#endif
}

// dictd's index: "headword \t offset \t length", numbers in base64 (A-Z a-z 0-9 + /).
int64_t dictd_number(const std::string& digits) {
  static const std::string alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  int64_t value = 0;
  for (char c : digits) {
    const auto at = alphabet.find(c);
    if (at == std::string::npos) throw DataError("malformed dictd index number " + digits);
    // Checked before it happens: value · 64 + digit must stay within int64.
    if (value > (std::numeric_limits<int64_t>::max() - static_cast<int64_t>(at)) / 64) {
      throw DataError("dictd index number " + digits + " is too large (more than 2^63 - 1)");
    }
    value = value * 64 + static_cast<int64_t>(at);
  }
  return value;
}

// A dictd database's entries in file order, without the 00-database-* header entries.
std::string dictd_entries(const std::string& dict_path) {
  const auto index_path = dict_path.substr(0, dict_path.size() - std::string(".dict.dz").size()) + ".index";
  const std::string body = gunzip(dict_path);
  std::ifstream index(index_path);
  if (!index) throw DataError("--data " + dict_path + ": its dictd index " + index_path + " is missing");
  std::set<std::pair<int64_t, int64_t>> entries;  // (offset, length), in file order
  std::string line;
  while (std::getline(index, line)) {
    std::stringstream fields(line);
    std::string headword, offset, length;
    if (!std::getline(fields, headword, '\t') || !std::getline(fields, offset, '\t') ||
        !std::getline(fields, length, '\t')) {
      continue;
    }
    if (headword.rfind("00database", 0) == 0 || headword.rfind("00-database", 0) == 0) continue;
    entries.emplace(dictd_number(offset), dictd_number(length));
  }
  std::string text;
  for (const auto& [offset, length] : entries) {
    const auto size = static_cast<int64_t>(body.size());
    if (offset < 0 || length < 0 || offset > size || length > size - offset) {  // no offset + length: it may overflow
      throw DataError("--data " + dict_path + ": its index points outside the dictionary");
    }
    text.append(body, static_cast<size_t>(offset), static_cast<size_t>(length));
  }
  return text;
}

}  // namespace

std::u32string decode_utf8(const std::string& text, const std::string& what) {
  std::u32string out;
  out.reserve(text.size());
  size_t i = 0;
  auto fail = [&](const char* why) {
    throw DataError(what + " is not UTF-8 text: " + why + " at byte " + std::to_string(i));
  };
  while (i < text.size()) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte == 0) fail("a NUL byte (binary data?)");
    int extra = 0;
    char32_t code = 0;
    if (byte < 0x80) {
      code = byte;
    } else if ((byte & 0xE0) == 0xC0) {
      extra = 1, code = byte & 0x1F;
    } else if ((byte & 0xF0) == 0xE0) {
      extra = 2, code = byte & 0x0F;
    } else if ((byte & 0xF8) == 0xF0) {
      extra = 3, code = byte & 0x07;
    } else {
      fail("an invalid leading byte");
    }
    if (i + static_cast<size_t>(extra) >= text.size() && extra > 0) fail("a truncated sequence");
    for (int k = 1; k <= extra; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      if ((next & 0xC0) != 0x80) fail("an invalid continuation byte");
      code = (code << 6) | (next & 0x3F);
    }
    static const char32_t smallest[] = {0, 0x80, 0x800, 0x10000};
    if (code < smallest[extra]) fail("an overlong sequence");
    if (code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) fail("a code point outside Unicode");
    out.push_back(code);
    i += static_cast<size_t>(extra) + 1;
  }
  return out;
}

std::string encode_utf8(const std::u32string& text) {
  std::string out;
  out.reserve(text.size());
  for (char32_t c : text) {
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
    } else if (c < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (c >> 6)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    } else if (c < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (c >> 12)));
      out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (c >> 18)));
      out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    }
  }
  return out;
}

std::string read_text(const std::string& path) {
  const std::string text = ends_with(path, ".dict.dz") ? dictd_entries(path) : read_bytes(path);
  if (text.empty()) throw DataError("--data " + path + ": the file is empty; expected a UTF-8 text to train on");
  decode_utf8(text, "--data " + path);  // throws for binary data
  return text;
}

std::u32string default_prompt(const std::u32string& text) {
  if (text.empty() || text.find(U'\n') != std::u32string::npos) return U"\n";
  return text.substr(0, 1);
}

CharTokenizer::CharTokenizer(const std::u32string& text) {
  const std::set<char32_t> distinct(text.begin(), text.end());
  characters_.assign(distinct.begin(), distinct.end());
}

torch::Tensor CharTokenizer::encode(const std::u32string& text, const std::string& what) const {
  std::vector<int64_t> ids;
  ids.reserve(text.size());
  std::set<char32_t> unknown;
  for (char32_t c : text) {
    const auto at = std::lower_bound(characters_.begin(), characters_.end(), c);
    if (at == characters_.end() || *at != c) {
      unknown.insert(c);
    } else {
      ids.push_back(at - characters_.begin());
    }
  }
  if (!unknown.empty()) {
    std::string listed;
    for (char32_t c : unknown) {
      char code[16];
      std::snprintf(code, sizeof(code), "U+%04X", static_cast<unsigned>(c));
      listed +=
          (listed.empty() ? "" : ", ") + std::string("'") + encode_utf8(std::u32string(1, c)) + "' (" + code + ")";
    }
    throw DataError(what + " has characters outside the model's vocabulary of " + std::to_string(size()) +
                    " characters: " + listed);
  }
  return torch::tensor(ids, torch::kLong);
}

std::string CharTokenizer::decode(const torch::Tensor& ids) const {
  const auto flat = ids.to(torch::kCPU, torch::kLong).contiguous();
  std::u32string text;
  text.reserve(static_cast<size_t>(flat.numel()));
  const auto* data = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i) {
    TORCH_CHECK(data[i] >= 0 && data[i] < size(), "CharTokenizer::decode: id ", data[i], " outside [0, ", size(), ")");
    text.push_back(characters_[static_cast<size_t>(data[i])]);
  }
  return encode_utf8(text);
}

char CharTokenizer::label(int64_t id) const {
  const char32_t c = characters_.at(static_cast<size_t>(id));
  if (c == U' ') return '_';
  if (c == U'\n') return '/';
  return c > 32 && c < 127 ? static_cast<char>(c) : '?';
}

TextData TextData::load(const std::string& path, int64_t context) {
  const auto raw = read_text(path);
  auto text = decode_utf8(raw, "--data " + path);
  CharTokenizer tokenizer(text);
  auto ids = tokenizer.encode(text, "--data " + path);
  const int64_t total = ids.numel();
  const int64_t validation_size = total / 10;
  // Each side needs at least one window of context + 1 characters (inputs and shifted targets).
  if (total - validation_size < context + 2 || validation_size < context + 1) {
    throw DataError("--data " + path + ": " + std::to_string(total) + " characters are too few for --seq-len " +
                    std::to_string(context) + " (training needs more than " + std::to_string(context + 1) +
                    " characters and the validation set, the last 10%, at least " + std::to_string(context + 1) + ")");
  }
  TextData data{path, std::move(text), std::move(tokenizer), {}, {}};
  data.train = ids.narrow(0, 0, total - validation_size);
  data.validation = ids.narrow(0, total - validation_size, validation_size);
  return data;
}

std::pair<torch::Tensor, torch::Tensor> TextData::training_batch(uint64_t seed, int64_t step, int64_t batch,
                                                                 int64_t context) const {
  auto generator = batch_generator(seed, step);
  const auto starts = at::randint(train.numel() - context, {batch}, generator, torch::kLong);  // (B,)
  const auto offsets = torch::arange(context + 1, torch::kLong);                               // (N + 1,)
  const auto windows = train.index({starts.unsqueeze(1) + offsets.unsqueeze(0)});              // (B, N + 1)
  return {windows.narrow(1, 0, context), windows.narrow(1, 1, context)};
}

std::pair<torch::Tensor, torch::Tensor> TextData::validation_windows(int64_t context, int64_t max_windows) const {
  const int64_t count = std::min<int64_t>(max_windows, (validation.numel() - 1) / context);
  const auto starts = torch::arange(count, torch::kLong) * context;                     // (W,)
  const auto offsets = torch::arange(context + 1, torch::kLong);                        // (N + 1,)
  const auto windows = validation.index({starts.unsqueeze(1) + offsets.unsqueeze(0)});  // (W, N + 1)
  return {windows.narrow(1, 0, context), windows.narrow(1, 1, context)};
}

double bigram_loss(const TextData& data, const torch::Tensor& inputs, const torch::Tensor& targets) {
  const int64_t V = data.tokenizer.size();
  // counts[a][b]: how often b follows a in the training set, plus one.
  auto counts = torch::ones({V, V}, torch::kDouble);
  const auto previous = data.train.narrow(0, 0, data.train.numel() - 1);
  const auto next = data.train.narrow(0, 1, data.train.numel() - 1);
  counts.view({-1}).index_add_(0, previous * V + next, torch::ones({previous.numel()}, torch::kDouble));
  const auto log_probabilities = (counts / counts.sum(1, /*keepdim=*/true)).log();  // (V, V)
  return -log_probabilities.index({inputs.reshape({-1}), targets.reshape({-1})}).mean().item<double>();
}

}  // namespace qkv_train::lm

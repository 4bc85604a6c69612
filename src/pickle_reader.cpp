// A stack machine over the opcodes of pickle protocol 2 that torch.save and LibTorch write
// (Python's Lib/pickle.py defines them; LibTorch's torch/csrc/jit/serialization/unpickler.cpp reads
// a subset). Python's rules throughout: a MARK opens a frame, and nothing below it can be popped
// until an opcode closes it; a GET needs a PUT; STOP leaves exactly one value.
//
// Two uses, both with Python's meaning of every opcode. A weights file (Weights) holds plain data
// and tensors. A torch::serialize archive (Archive: qkv-train's checkpoints) holds TorchScript
// objects besides: GLOBAL __torch__.<class>, an empty tuple and NEWOBJ make one, BUILD gives it a
// dict of attributes. They are read as ArchiveObjects, whose class is never looked up: the class
// definitions TorchScript's importer would compile from the archive's code/ are not read at all.
#include "pickle_reader.h"

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace qkv::detail {
namespace {

// Deeper than any state dict (about 4: a dict, a tensor's arguments, their tuples) by far, and
// shallow enough that destroying the nested IValues, which recurses, fits a small thread stack.
constexpr int kMaxNesting = 200;

enum class Use { Weights, Archive };

struct Value;
using ValuePtr = std::shared_ptr<Value>;

struct Value {
  enum class Kind { None, Bool, Int, Float, String, Tuple, List, Dict, Global, Class, Object, Storage, Tensor };
  Kind kind = Kind::None;
  int64_t integer = 0;          // Int; Storage: its elements
  std::string text;             // String; Global: "module.name"
  std::vector<ValuePtr> items;  // Tuple: its items; Dict (Archive): keys and values, alternating
  int nesting = 1;              // containers inside containers, itself included
  bool contained = false;       // List, Dict, Object: placed inside another value, so finished
  bool function = false;        // Global: callable (a storage type is not)
  bool ordered_dict = false;    // Dict: made by collections.OrderedDict (BUILD may give it attributes)
  std::shared_ptr<ArchiveObject> object;  // Object: null until BUILD gives it its attributes
  c10::IValue ivalue;           // the value itself (not for Class and Object)
};

ValuePtr make(Value::Kind kind) {
  auto v = std::make_shared<Value>();
  v->kind = kind;
  return v;
}

// torch.<Name>Storage → its scalar type, for the types this LibTorch's unpickler knows.
const std::map<std::string, at::ScalarType>& storage_types() {
  static const std::map<std::string, at::ScalarType> types = [] {
    std::map<std::string, at::ScalarType> t;
#define QKV_STORAGE_TYPE(ctype, name) t.emplace("torch." #name "Storage", at::k##name);
    AT_FORALL_SCALAR_TYPES_WITH_COMPLEX_AND_QINTS(QKV_STORAGE_TYPE)
#undef QKV_STORAGE_TYPE
    return t;
  }();
  return types;
}

bool is_storage_type(const Value& v) { return v.kind == Value::Kind::Global && storage_types().count(v.text) > 0; }

bool is_type_tag(const std::string& global) { return global.rfind("torch.jit._pickle.", 0) == 0; }

bool word_character(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// `text` as a message can show it: printable ASCII as it is, other bytes as \xNN, at most 64.
std::string printable(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size() && i < 64; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      static const char* const hex = "0123456789abcdef";
      out += std::string("\\x") + hex[c >> 4] + hex[c & 15];
    }
  }
  return text.size() > 64 ? out + "..." : out;
}

// A TorchScript class of an archive: __torch__.Module, __torch__.___torch_mangle_7.Module, ...
bool is_archive_class(const std::string& module, const std::string& name) {
  const auto word = [](const std::string& w) {
    return !w.empty() && std::all_of(w.begin(), w.end(), [](char c) { return word_character(c); });
  };
  if (module != "__torch__" && module.rfind("__torch__.", 0) != 0) return false;
  std::stringstream parts(module);
  for (std::string part; std::getline(parts, part, '.');) {
    if (!word(part)) return false;
  }
  return word(name);
}

// The attribute names LibTorch's writer prints as they are into the class definitions it writes
// (TorchScript source) when the archive is written again: names of modules, parameters and
// optimizer state ("W_q", "0", "param_groups/size", "0x55d0c4a0b2f0", "_growth_tracker"). Nothing
// that could end a string or a line there, no __dunder__ that TorchScript reads itself, no keyword
// of Python's or of TorchScript's lexer (an attribute named NoneType failed an internal assert of
// LibTorch 1.13's importer).
bool is_archive_attribute_name(const std::string& name) {
  static const char* const keywords[] = {
      "False", "None",   "True",    "and",      "as",   "assert", "async",  "await",  "break",
      "class", "continue", "def",   "del",      "elif", "else",   "except", "finally", "for",
      "from",  "global", "if",      "import",   "in",   "is",     "lambda", "nonlocal", "not",
      "or",    "pass",   "raise",   "return",   "try",  "while",  "with",   "yield",  "Ellipsis",
      "NoneType"};
  if (name.empty() || name.size() > 256 || name.rfind("__", 0) == 0) return false;
  if (!std::all_of(name.begin(), name.end(), [](char c) { return word_character(c) || c == '/'; })) {
    return false;
  }
  return std::none_of(std::begin(keywords), std::end(keywords), [&](const char* k) { return name == k; });
}

// The globals a weights file may name (besides the storage types).
bool weights_global(const std::string& name) {
  static const char* const allowed[] = {
      "collections.OrderedDict",         "torch._utils._rebuild_tensor_v2",  "torch._utils._rebuild_parameter",
      "torch.jit._pickle.restore_type_tag", "torch.jit._pickle.build_intlist", "torch.jit._pickle.build_tensorlist",
      "torch.jit._pickle.build_doublelist", "torch.jit._pickle.build_boollist"};
  return std::find_if(std::begin(allowed), std::end(allowed), [&](const char* a) { return name == a; }) !=
         std::end(allowed);
}

class PickleMachine {
 public:
  PickleMachine(Use use, const char* data, size_t size, std::string storage_folder, const StorageEntries& entries,
                std::string where)
      : use_(use),
        data_(reinterpret_cast<const unsigned char*>(data)),
        size_(size),
        storage_folder_(std::move(storage_folder)),
        entries_(entries),
        where_(std::move(where)) {}

  ValuePtr run() {
    frames_.emplace_back();
    if (size_ < 2 || data_[0] != 0x80) fail("does not start with a pickle's PROTO opcode");
    // torch.save writes protocol 2 unless given pickle_protocol=.
    if (data_[1] < 2 || data_[1] > 5) fail("is pickle protocol " + std::to_string(data_[1]) + "; expected 2 to 5");
    position_ = 2;
    while (true) {
      opcode_at_ = position_;
      const unsigned char opcode = read_byte();
      if (opcode == '.') break;  // STOP
      try {
        step(opcode);
      } catch (const c10::Error& e) {
        if (failing_) throw;
        // LibTorch's own refusals on the way, placed in the file.
        fail(std::string("is refused by LibTorch (") + e.what_without_backtrace() + ")");
      } catch (const std::exception& e) {  // e.g. a list as a dict key: std::runtime_error "Can't hash ..."
        fail(std::string("is refused by LibTorch (") + e.what() + ")");
      }
    }
    if (frames_.size() != 1) fail("ends with a MARK still open");
    if (frames_[0].size() != 1) fail("ends with " + std::to_string(frames_[0].size()) + " values where one belongs");
    const auto& result = frames_[0][0];
    if (use_ == Use::Archive && (result->kind != Value::Kind::Object || !result->object)) {
      fail("holds something other than an archive's object");
    }
    return result;
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    failing_ = true;
    TORCH_CHECK(false, where_, " ", what, " at byte ", opcode_at_, "; the file is corrupt or was not written by ",
                use_ == Use::Weights ? "torch.save" : "LibTorch's torch::serialize::OutputArchive");
  }

  // --- input ---
  void need(uint64_t n) {
    if (n > size_ - position_) fail("runs past the end of the pickle");
  }
  unsigned char read_byte() {
    need(1);
    return data_[position_++];
  }
  uint64_t read_little_endian(size_t bytes) {
    need(bytes);
    uint64_t v = 0;
    for (size_t i = 0; i < bytes; ++i) v |= uint64_t(data_[position_ + i]) << (8 * i);
    position_ += bytes;
    return v;
  }
  std::string read_line() {
    const auto* start = data_ + position_;
    const auto* end = static_cast<const unsigned char*>(std::memchr(start, '\n', size_ - position_));
    if (end == nullptr) fail("has a GLOBAL without its line's end");
    position_ += static_cast<size_t>(end - start) + 1;
    return std::string(reinterpret_cast<const char*>(start), static_cast<size_t>(end - start));
  }

  // --- stack ---
  std::vector<ValuePtr>& frame() { return frames_.back(); }
  void require(size_t n, const char* opcode) {
    if (frame().size() < n) {
      const size_t there = frame().size();
      fail(std::string(opcode) + " needs " + std::to_string(n) + " values " +
           (frames_.size() > 1 ? "above its MARK" : "on the stack") + ", and there " +
           (there == 1 ? "is 1" : "are " + std::to_string(there)));
    }
  }
  ValuePtr pop() {
    auto v = std::move(frame().back());
    frame().pop_back();
    return v;
  }
  void push(ValuePtr v) { frame().push_back(std::move(v)); }
  std::vector<ValuePtr> pop_frame(const char* opcode) {
    if (frames_.size() < 2) fail(std::string(opcode) + " closes a MARK where none is open");
    auto items = std::move(frames_.back());
    frames_.pop_back();
    return items;
  }

  // --- containers ---
  void contain(Value& parent, const ValuePtr& child) {
    child->contained = true;
    parent.nesting = std::max(parent.nesting, child->nesting + 1);
    if (parent.nesting > kMaxNesting) fail("nests containers more than " + std::to_string(kMaxNesting) + " deep");
  }
  ValuePtr tuple(std::vector<ValuePtr> items) {
    auto t = make(Value::Kind::Tuple);
    std::vector<c10::IValue> elements;
    for (const auto& item : items) {
      contain(*t, item);
      elements.push_back(item->ivalue);
    }
    t->ivalue = c10::ivalue::Tuple::create(std::move(elements));
    t->items = std::move(items);
    return t;
  }
  ValuePtr new_list() {
    auto list = make(Value::Kind::List);
    list->ivalue = c10::impl::GenericList(c10::AnyType::get());
    return list;
  }
  ValuePtr new_dict() {
    auto dict = make(Value::Kind::Dict);
    dict->ivalue = c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get());
    return dict;
  }
  // APPEND(S), SETITEM(S), DICT, LIST: `items` go into the list or dict `target`.
  void add_to(Value& target, const std::vector<ValuePtr>& items, const char* opcode) {
    // Writers finish a container before placing it in another; changing it afterwards could
    // nest deeper than the depth counted here (and is how a container could hold itself).
    if (target.contained) fail(std::string(opcode) + " changes a container already inside another");
    if (target.kind != Value::Kind::List && target.kind != Value::Kind::Dict) {
      fail(std::string(opcode) + " adds items to something that is not a list or dict");
    }
    for (const auto& item : items) {
      if (item.get() == &target) fail(std::string(opcode) + " puts a container inside itself");
      contain(target, item);
    }
    if (target.kind == Value::Kind::List) {
      auto list = target.ivalue.toList();
      for (const auto& item : items) list.push_back(item->ivalue);
    } else {
      if (items.size() % 2 != 0) fail(std::string(opcode) + " gives a dict a key without a value");
      auto dict = target.ivalue.toGenericDict();
      for (size_t i = 0; i < items.size(); i += 2) dict.insert_or_assign(items[i]->ivalue, items[i + 1]->ivalue);
      if (use_ == Use::Archive) target.items.insert(target.items.end(), items.begin(), items.end());  // for BUILD
    }
  }

  // --- memo ---
  void put(uint64_t id) {
    // LibTorch keeps its memo in a vector as long as the largest id: bounded here by the
    // pickle's size (writers number their PUTs from 0), not 2^32 entries of 16 bytes.
    if (id > size_) fail("PUT names memo entry " + std::to_string(id) + " in a pickle of " + std::to_string(size_) + " bytes");
    if (frame().empty()) fail("PUT finds nothing on the stack");
    memo_[id] = frame().back();
  }
  void get(uint64_t id) {
    const auto found = memo_.find(id);
    if (found == memo_.end()) fail("GET names memo entry " + std::to_string(id) + ", which no PUT made");
    push(found->second);
  }

  // --- globals, storages, tensors ---
  void global(const std::string& module, const std::string& name) {
    if (use_ == Use::Archive && is_archive_class(module, name)) {
      push(make(Value::Kind::Class));
      return;
    }
    auto g = make(Value::Kind::Global);
    g->text = module + "." + name;
    g->function = !is_storage_type(*g);
    if (!is_storage_type(*g) && !weights_global(g->text)) {
      fail("names " + printable(g->text) + ", which a" +
           (use_ == Use::Weights ? " weights file does not hold (dicts, lists, numbers, strings and tensors)"
                                 : "n archive does not hold (its objects, numbers, strings and tensors)"));
    }
    push(std::move(g));
  }

  // BINPERSID: ('storage', torch.<T>Storage, key, location, elements) → a storage of that many
  // elements over the entry <storage folder><key>. LibTorch compares neither size.
  void persistent_id() {
    require(1, "BINPERSID");
    const auto id = pop();
    const auto& a = id->items;
    if (id->kind != Value::Kind::Tuple || a.size() != 5 || a[0]->kind != Value::Kind::String ||
        a[0]->text != "storage" || !is_storage_type(*a[1]) || a[2]->kind != Value::Kind::String ||
        a[3]->kind != Value::Kind::String || a[4]->kind != Value::Kind::Int) {
      fail("has a persistent id other than ('storage', torch.<type>Storage, key, location, elements)");
    }
    const auto type = storage_types().at(a[1]->text);
    const uint64_t element_size = c10::elementSize(type);
    const int64_t elements = a[4]->integer;
    const auto entry = storage_folder_ + a[2]->text;
    if (elements < 0) fail("gives storage " + entry + " " + std::to_string(elements) + " elements");
    const auto bytes = entries_.size(entry);
    if (elements > 0 && !bytes) fail("names storage " + entry + ", which the archive does not hold");
    if (elements > 0 && uint64_t(elements) > *bytes / element_size) {
      fail("gives storage " + entry + " " + std::to_string(elements) + " elements of " + std::to_string(element_size) +
           " bytes, but its entry holds " + std::to_string(*bytes) + " bytes");
    }
    auto storage = make(Value::Kind::Storage);
    storage->integer = elements;
    // Every tensor over one key shares one storage, as in Python. A weights file's are loaded to
    // the CPU wherever they were saved (a GPU's weights load on a machine without one); the
    // module's parameters then take them to their own device.
    auto found = storages_.find(entry);
    if (found == storages_.end() || found->second.nbytes() < uint64_t(elements) * element_size) {
      at::DataPtr data = elements > 0 ? entries_.read(entry) : at::DataPtr(nullptr, at::Device(at::kCPU));
      found = storages_
                  .insert_or_assign(entry, at::Storage(c10::Storage::use_byte_size_t(), elements * element_size,
                                                       std::move(data), /*allocator=*/nullptr, /*resizable=*/false))
                  .first;
    }
    storage->ivalue = at::empty({0}, at::TensorOptions().dtype(type)).set_(found->second);
    const auto& location = a[3]->text;
    if (use_ == Use::Archive && location != "cpu") {
      // A checkpoint's tensors go back where they were saved, as LibTorch's reader puts them: a
      // CUDA run's parameters and optimizer state to the GPU (Module::load moves a parameter to
      // the device of the tensor it reads). One copy per entry and device, shared as saved.
      const auto key = entry + "@" + location;
      auto moved = device_storages_.find(key);
      const auto& cpu = storage->ivalue.toTensor();
      if (moved == device_storages_.end() || moved->second.nbytes() < cpu.storage().nbytes()) {
        moved = device_storages_.insert_or_assign(key, cpu.to(at::Device(location)).storage()).first;
      }
      storage->ivalue =
          at::empty({0}, at::TensorOptions().dtype(type).device(moved->second.device())).set_(moved->second);
    }
    push(std::move(storage));
  }

  static bool int_tuple(const Value& v) {
    return v.kind == Value::Kind::Tuple && std::all_of(v.items.begin(), v.items.end(), [](const ValuePtr& item) {
             return item->kind == Value::Kind::Int;
           });
  }

  // torch._utils._rebuild_tensor_v2(storage, offset, sizes, strides, requires_grad, hooks, ...):
  // every element the tensor reaches lies in its storage.
  ValuePtr rebuild_tensor(const Value& arguments) {
    const auto& a = arguments.items;
    if (arguments.kind != Value::Kind::Tuple || a.size() < 4 || a[0]->kind != Value::Kind::Storage ||
        a[1]->kind != Value::Kind::Int || !int_tuple(*a[2]) || !int_tuple(*a[3]) ||
        a[2]->items.size() != a[3]->items.size()) {
      fail("rebuilds a tensor from arguments other than (storage, offset, sizes, strides, ...)");
    }
    const int64_t offset = a[1]->integer;
    if (offset < 0) fail("rebuilds a tensor at a negative offset");
    std::vector<int64_t> sizes, strides;
    bool empty = false, overflow = false;
    int64_t last = offset;  // the last element's index: offset + Σ (size - 1) · stride
    for (size_t d = 0; d < a[2]->items.size(); ++d) {
      const int64_t size = a[2]->items[d]->integer, stride = a[3]->items[d]->integer;
      if (size < 0 || stride < 0) fail("rebuilds a tensor with a negative size or stride");
      empty = empty || size == 0;
      int64_t reach = 0;
      overflow = overflow || __builtin_mul_overflow(size > 0 ? size - 1 : 0, stride, &reach) ||
                 __builtin_add_overflow(last, reach, &last);
      sizes.push_back(size);
      strides.push_back(stride);
    }
    if (!empty && (overflow || last >= a[0]->integer)) {
      fail("rebuilds a tensor that reaches " +
           (overflow ? std::string("past element 2^63") : "element " + std::to_string(last)) + " of a storage of " +
           std::to_string(a[0]->integer));
    }
    auto tensor = make(Value::Kind::Tensor);
    const auto& storage = a[0]->ivalue.toTensor();
    tensor->ivalue = at::empty({0}, storage.options()).set_(storage.storage(), offset, sizes, strides);
    return tensor;
  }

  // REDUCE: function(argument), for the globals a weights file may call.
  void reduce(const char* opcode) {
    require(2, opcode);
    auto argument = pop();
    const auto function = pop();
    if (function->kind != Value::Kind::Global || !function->function) {
      fail(std::string(opcode) + " calls something that is not a function");
    }
    const auto& name = function->text;
    if (is_type_tag(name) && argument->kind == Value::Kind::Tuple && !argument->items.empty()) {
      // restore_type_tag, build_intlist, ... give back the container they were handed, itself:
      // still inside its tuple, so finished.
      push(argument->items[0]);
      return;
    }
    if (name == "torch._utils._rebuild_tensor_v2") {
      push(rebuild_tensor(*argument));
      return;
    }
    if (name == "collections.OrderedDict") {
      if (argument->kind != Value::Kind::Tuple || !argument->items.empty()) {
        fail("builds an OrderedDict from arguments; torch.save gives it none and then its items");
      }
      auto dict = new_dict();
      dict->ordered_dict = true;
      push(std::move(dict));
      return;
    }
    if (name == "torch._utils._rebuild_parameter") {  // (data, requires_grad, hooks): the data
      if (argument->kind != Value::Kind::Tuple || argument->items.empty() ||
          argument->items[0]->kind != Value::Kind::Tensor) {
        fail("rebuilds a parameter from arguments other than (tensor, requires_grad, hooks)");
      }
      push(argument->items[0]);
      return;
    }
    fail(std::string(opcode) + " calls " + name + " with arguments it does not take");
  }

  // NEWOBJ: class(*arguments). An archive's objects are made with no arguments, then built.
  void new_object() {
    if (use_ == Use::Weights) fail("NEWOBJ makes an object, which a weights file does not hold");
    require(2, "NEWOBJ");
    const auto arguments = pop();
    const auto type = pop();
    if (type->kind != Value::Kind::Class) fail("NEWOBJ makes something other than an archive's object");
    if (arguments->kind != Value::Kind::Tuple || !arguments->items.empty()) {
      fail("NEWOBJ gives an archive's object arguments; LibTorch gives it none and then its attributes");
    }
    push(make(Value::Kind::Object));
  }

  // BUILD: the object below takes the state on top as its attributes. A weights file's only such
  // objects are OrderedDicts (Module.state_dict()'s _metadata), which the dict read here drops. An
  // archive's objects take a dict of their attributes, once.
  void build() {
    require(2, "BUILD");
    const auto state = pop();
    auto& target = *frame().back();
    if (use_ == Use::Weights || target.kind != Value::Kind::Object) {
      if (!target.ordered_dict) fail("BUILD gives attributes to something other than an OrderedDict");
      return;
    }
    if (target.object) fail("BUILD gives an object attributes a second time");
    if (state->kind != Value::Kind::Dict) fail("BUILD gives an object attributes other than a dict");
    auto object = std::make_shared<ArchiveObject>();
    std::unordered_set<std::string> seen;
    for (size_t i = 0; i + 1 < state->items.size(); i += 2) {
      const auto& key = state->items[i];
      const auto& value = state->items[i + 1];
      if (key->kind != Value::Kind::String) fail("BUILD names an attribute with something other than a string");
      if (!is_archive_attribute_name(key->text)) {
        fail("names an attribute \"" + printable(key->text) +
             "\"; expected letters, digits, '_' and '/' (not a Python keyword, not starting with __)");
      }
      if (!seen.insert(key->text).second) fail("gives an object the attribute " + key->text + " twice");
      contain(target, value);
      object->attributes.push_back(archive_attribute(key->text, *value));
    }
    state->contained = true;
    target.object = std::move(object);
  }

  // One attribute of an archive's object: a nested object, or a value LibTorch's writer writes as
  // one (a tensor, a number, a string, None, or a tuple of the scalars).
  ArchiveObject::Attribute archive_attribute(const std::string& name, const Value& value) {
    ArchiveObject::Attribute attribute;
    attribute.name = name;
    using Kind = Value::Kind;
    const auto scalar = [](const Value& v) {
      return v.kind == Kind::None || v.kind == Kind::Bool || v.kind == Kind::Int || v.kind == Kind::Float ||
             v.kind == Kind::String;
    };
    if (value.kind == Kind::Object) {
      if (!value.object) fail("gives attribute " + name + " an object that BUILD has not finished");
      attribute.object = value.object;
    } else if (scalar(value) || value.kind == Kind::Tensor ||
               (value.kind == Kind::Tuple &&
                std::all_of(value.items.begin(), value.items.end(), [&](const ValuePtr& item) { return scalar(*item); }))) {
      attribute.value = value.ivalue;
    } else {
      fail("gives attribute " + name + " a value an archive does not hold (expected an object, a tensor, a number, "
           "a string, None or a tuple of those scalars)");
    }
    return attribute;
  }

  void step(unsigned char opcode) {
    switch (opcode) {
      case '(':  // MARK
        frames_.emplace_back();
        break;
      case ')':  // EMPTY_TUPLE
        push(tuple({}));
        break;
      case ']':  // EMPTY_LIST
        push(new_list());
        break;
      case '}':  // EMPTY_DICT
        push(new_dict());
        break;
      case 'N': {  // NONE
        push(make(Value::Kind::None));
        break;
      }
      case 0x88:    // NEWTRUE
      case 0x89: {  // NEWFALSE
        auto v = make(Value::Kind::Bool);
        v->ivalue = opcode == 0x88;
        push(std::move(v));
        break;
      }
      case 'K':    // BININT1
      case 'M':    // BININT2
      case 'J': {  // BININT (signed)
        const uint64_t raw = read_little_endian(opcode == 'K' ? 1 : opcode == 'M' ? 2 : 4);
        push_int(opcode == 'J' ? int64_t(int32_t(uint32_t(raw))) : int64_t(raw));
        break;
      }
      case 0x8a: {  // LONG1: n bytes, little-endian two's complement
        const size_t bytes = read_byte();
        if (bytes > 8) fail("has an integer of " + std::to_string(bytes) + " bytes");
        const uint64_t raw = read_little_endian(bytes);
        const int shift = 64 - 8 * static_cast<int>(bytes);
        push_int(bytes == 0 ? 0 : bytes == 8 ? int64_t(raw) : int64_t(raw << shift) >> shift);
        break;
      }
      case 'G': {  // BINFLOAT: big-endian double
        const uint64_t raw = read_little_endian(8);
        uint64_t swapped = 0;
        for (int i = 0; i < 8; ++i) swapped |= ((raw >> (8 * i)) & 0xFF) << (8 * (7 - i));
        double real = 0;
        std::memcpy(&real, &swapped, sizeof real);
        auto v = make(Value::Kind::Float);
        v->ivalue = real;
        push(std::move(v));
        break;
      }
      case 'X':      // BINUNICODE
      case 0x8c:     // SHORT_BINUNICODE (protocol 4)
      case 0x8d: {   // BINUNICODE8 (protocol 4)
        const uint64_t length = read_little_endian(opcode == 'X' ? 4 : opcode == 0x8c ? 1 : 8);
        need(length);
        auto v = make(Value::Kind::String);
        v->text.assign(reinterpret_cast<const char*>(data_ + position_), length);
        position_ += length;
        v->ivalue = v->text;
        push(std::move(v));
        break;
      }
      case 't':  // TUPLE
        push(tuple(pop_frame("TUPLE")));
        break;
      case 0x85:    // TUPLE1
      case 0x86:    // TUPLE2
      case 0x87: {  // TUPLE3
        const size_t n = opcode - 0x84;
        require(n, opcode == 0x85 ? "TUPLE1" : opcode == 0x86 ? "TUPLE2" : "TUPLE3");
        std::vector<ValuePtr> items(frame().end() - static_cast<std::ptrdiff_t>(n), frame().end());
        frame().resize(frame().size() - n);
        push(tuple(std::move(items)));
        break;
      }
      case 'l': {  // LIST
        auto items = pop_frame("LIST");
        auto list = new_list();
        add_to(*list, items, "LIST");
        push(std::move(list));
        break;
      }
      case 'd': {  // DICT
        auto items = pop_frame("DICT");
        if (items.size() % 2 != 0) fail("DICT gives a key without a value");
        auto dict = new_dict();
        add_to(*dict, items, "DICT");
        push(std::move(dict));
        break;
      }
      case 'a': {  // APPEND
        require(2, "APPEND");
        auto item = pop();
        add_to(*frame().back(), {item}, "APPEND");
        break;
      }
      case 'e':    // APPENDS
      case 'u': {  // SETITEMS
        const char* name = opcode == 'e' ? "APPENDS" : "SETITEMS";
        auto items = pop_frame(name);
        if (opcode == 'u' && items.size() % 2 != 0) fail("SETITEMS gives a key without a value");
        require(1, name);
        add_to(*frame().back(), items, name);
        break;
      }
      case 's': {  // SETITEM
        require(3, "SETITEM");
        auto value = pop();
        auto key = pop();
        add_to(*frame().back(), {key, value}, "SETITEM");
        break;
      }
      case 'q':  // BINPUT
        put(read_little_endian(1));
        break;
      case 'r':  // LONG_BINPUT
        put(read_little_endian(4));
        break;
      case 'h':  // BINGET
        get(read_little_endian(1));
        break;
      case 'j':  // LONG_BINGET
        get(read_little_endian(4));
        break;
      case 'c': {  // GLOBAL
        const auto module = read_line();
        const auto name = read_line();
        global(module, name);
        break;
      }
      case 0x93: {  // STACK_GLOBAL (protocol 4): module and name from the stack
        require(2, "STACK_GLOBAL");
        const auto name = pop(), module = pop();
        if (module->kind != Value::Kind::String || name->kind != Value::Kind::String) {
          fail("STACK_GLOBAL names a global with something other than two strings");
        }
        global(module->text, name->text);
        break;
      }
      case 0x94:  // MEMOIZE (protocol 4): PUT with the next free id
        put(memo_.size());
        break;
      case 0x95:  // FRAME (protocol 4): the length of what follows, for buffered reading
        read_little_endian(8);
        break;
      case 0x81:  // NEWOBJ
        new_object();
        break;
      case 'R':
        reduce("REDUCE");
        break;
      case 'b':
        build();
        break;
      case 'Q':  // BINPERSID
        persistent_id();
        break;
      default: {
        std::ostringstream text;
        text << "has opcode 0x" << std::hex << int(opcode) << ", which torch.save's pickles do not use";
        fail(text.str());
      }
    }
  }

  void push_int(int64_t integer) {
    auto v = make(Value::Kind::Int);
    v->integer = integer;
    v->ivalue = integer;
    push(std::move(v));
  }

  Use use_;
  bool failing_ = false;  // fail() threw: its error passes run()'s catch unchanged
  const unsigned char* data_;
  size_t size_;
  size_t position_ = 0, opcode_at_ = 0;
  std::string storage_folder_;
  const StorageEntries& entries_;
  std::string where_;
  std::vector<std::vector<ValuePtr>> frames_;  // frames_[0]: below every MARK
  std::unordered_map<uint64_t, ValuePtr> memo_;
  std::unordered_map<std::string, at::Storage> storages_;         // by entry, on the CPU
  std::unordered_map<std::string, at::Storage> device_storages_;  // Archive: by entry@device, elsewhere
};

}  // namespace

c10::IValue read_weights_pickle(const char* data, size_t size, const std::string& storage_folder,
                                const StorageEntries& entries, const std::string& where) {
  return PickleMachine(Use::Weights, data, size, storage_folder, entries, where).run()->ivalue;
}

std::shared_ptr<ArchiveObject> read_archive_pickle(const char* data, size_t size, const std::string& storage_folder,
                                                   const StorageEntries& entries, const std::string& where) {
  return PickleMachine(Use::Archive, data, size, storage_folder, entries, where).run()->object;
}

}  // namespace qkv::detail

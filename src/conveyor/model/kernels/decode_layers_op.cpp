// The one-call decode layers as a torch class and operator (torch.classes.<namespace>.DecodeLayers,
// torch.ops.<namespace>.decode_layers; kernels/decode_layer.py): a model's layers' weights,
// checked against each other as they are added, and one decode step over all of them. The
// tensors are checked as ops.cpp checks its operators' (tensor_checks.h) before decode_layer.cpp
// runs them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "decode_layer.h"
#include "tensor_checks.h"
#include "vec.h"

#ifndef CONVEYOR_OPS_NAMESPACE
#define CONVEYOR_OPS_NAMESPACE conveyor
#endif
#define CONVEYOR_STRING(x) #x
#define CONVEYOR_NAME(x) CONVEYOR_STRING(x)

using at::ScalarType;
using at::Tensor;
using namespace conveyor;
using namespace conveyor::ops;

// A namespace named per build: torch keys custom classes by their C++ type, and clang gives a
// type in an anonymous namespace one identity in every library that defines it, so two builds
// (tests load several) would register the same class.
namespace CONVEYOR_OPS_NAMESPACE {

const char* const kProjections[4] = {"qkv", "o", "gate_up", "down"};

// A model's decoder layers for decode_layers, built once at load time: each layer's weight
// tensors, checked against each other when added and kept alive here, and the LayerWeights
// pointing into them.
struct DecodeLayers : torch::CustomClassHolder {
  std::vector<LayerWeights> layers;
  std::vector<Tensor> tensors;
  ScalarType dtype = at::kFloat;
  int64_t max_rows_ = -1;  // rows the layers serve: -1 for any number

  // A layer: its norms ([hidden] in the activations' dtype, every layer's the same) and sizes;
  // its four projections follow (add_projection). What a layer may add to Llama's: q/k norms
  // ([head_dim] each, per head before the rotary: Qwen3, Gemma 3), norms of the attention's and
  // the MLP's outputs ([hidden]; Gemma 3), the tanh GeLU gate ("gelu_tanh"), an attention scale
  // of its own (none: head_dim ** -0.5), and which of the call's rotary tables it takes.
  void add_layer(const Tensor& input_norm, const Tensor& post_norm, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, double eps, int64_t window,
                 const std::optional<Tensor>& q_norm, const std::optional<Tensor>& k_norm,
                 const std::optional<Tensor>& post_attention_norm,
                 const std::optional<Tensor>& post_feedforward_norm,
                 const std::string& activation, std::optional<double> scale, int64_t rotary) {
    TORCH_CHECK(complete(), "the last layer added lacks projections (add_projection)");
    check_activation_dtype(input_norm, "input_norm");
    TORCH_CHECK(input_norm.dim() == 1, "input_norm must be 1-D, got shape ", input_norm.sizes());
    const int64_t hidden = input_norm.size(0);
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
                "num_heads must be a positive multiple of num_kv_heads, got ", num_heads, " and ",
                num_kv_heads);
    check_multiple(hidden, kLanes, "input_norm's size (hidden)");
    check_multiple(head_dim, 2 * kLanes, "head_dim");
    const ScalarType type = layers.empty() ? input_norm.scalar_type() : dtype;
    if (!layers.empty())
      TORCH_CHECK(input_norm.scalar_type() == dtype && hidden == layers[0].hidden &&
                      num_heads == layers[0].num_heads && num_kv_heads == layers[0].num_kv_heads &&
                      head_dim == layers[0].head_dim,
                  "every layer must have the first one's dtype and sizes");
    check_tensor(input_norm, "input_norm", type, {hidden});
    check_tensor(post_norm, "post_norm", type, {hidden});
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
    for (const auto& [norm, name, size] :
         {std::tuple{&q_norm, "q_norm", head_dim}, std::tuple{&k_norm, "k_norm", head_dim},
          std::tuple{&post_attention_norm, "post_attention_norm", hidden},
          std::tuple{&post_feedforward_norm, "post_feedforward_norm", hidden}})
      if (*norm) check_tensor(**norm, name, type, {size});
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh",
                "activation must be \"silu\" or \"gelu_tanh\", got \"", activation, "\"");
    TORCH_CHECK(!scale || (std::isfinite(*scale) && *scale > 0),
                "scale must be positive and finite (or None: head_dim ** -0.5), got ", *scale);
    TORCH_CHECK(window >= 0, "window must be 0 (none) or positive, got ", window);
    TORCH_CHECK(rotary >= 0, "rotary must be >= 0 (an index into the call's cos and sin), got ",
                rotary);
    LayerWeights w{};
    auto hold = [&](const std::optional<Tensor>& t) -> const void* {
      if (!t) return nullptr;
      tensors.push_back(*t);
      return t->data_ptr();
    };
    w.input_norm = hold(input_norm);
    w.post_norm = hold(post_norm);
    w.q_norm = hold(q_norm);
    w.k_norm = hold(k_norm);
    w.post_attention_norm = hold(post_attention_norm);
    w.post_feedforward_norm = hold(post_feedforward_norm);
    w.hidden = hidden;
    w.num_heads = num_heads;
    w.num_kv_heads = num_kv_heads;
    w.head_dim = head_dim;
    w.eps = static_cast<float>(eps);
    // As the Python path's scale reaches paged_attention (a double rounded to float); without
    // one, as Python's head_dim ** -0.5 (the same libm pow).
    w.scale = static_cast<float>(scale ? *scale
                                       : std::pow(static_cast<double>(head_dim), -0.5));
    w.activation = activation == "gelu_tanh" ? Activation::kGeluTanh : Activation::kSilu;
    w.window = window;
    w.rotary = rotary;
    dtype = type;
    layers.push_back(w);
    projections_ = 0;
  }

  // The last layer's next projection's name and [n_out, k] for a weight of `rows` outputs
  // (gate_up's give the intermediate size).
  std::string next_projection(int64_t rows, int64_t max_block_rows, int64_t& n_out, int64_t& k) {
    TORCH_CHECK(!complete(), "add_layer first: the last layer has its four projections");
    LayerWeights& w = layers.back();
    const int p = static_cast<int>(projections_);
    if (p == 2) {
      w.intermediate = rows / 2;
      check_multiple(w.intermediate, kLanes, "half of gate_up's outputs (intermediate)");
      TORCH_CHECK(w.intermediate == layers[0].intermediate,
                  "every layer must have the first one's intermediate size");
    }
    const int64_t q_size = w.num_heads * w.head_dim, kv_size = w.num_kv_heads * w.head_dim;
    const int64_t shapes[4][2] = {{q_size + 2 * kv_size, w.hidden}, {w.hidden, q_size},
                                  {2 * w.intermediate, w.hidden}, {w.hidden, w.intermediate}};
    n_out = shapes[p][0];
    k = shapes[p][1];
    const std::string name = kProjections[p];
    TORCH_CHECK(max_block_rows >= 0, name, "'s max_block_rows must be >= 0, got ", max_block_rows);
    return name;
  }

  // The last layer's next projection [n_out, k], in qkv, o, gate_up, down order: its 4-bit
  // blocks (codes, scale, minimum) serving up to max_block_rows rows, as BlockPanels
  // (panel_gemm.cpp's layout) where block_panels says so, else as NibbleInt4; then what serves
  // more rows, if anything: its panels.
  void add_projection(const Tensor& codes, const Tensor& scale, const Tensor& minimum,
                      int64_t max_block_rows, bool block_panels,
                      const std::optional<Tensor>& panels) {
    TORCH_CHECK(codes.dim() == 2, kProjections[projections_ % 4],
                "'s codes must be 2-D, got shape ", codes.sizes());
    int64_t n_out, k;
    const std::string name = next_projection(codes.size(0), max_block_rows, n_out, k);
    TORCH_CHECK(codes.size(0) == n_out, name, "'s codes must have ", n_out,
                " rows, got shape ", codes.sizes());
    if (block_panels)
      check_block_panels(codes, scale, minimum, (name + " block panels' ").c_str(), dtype, n_out,
                         k);
    else
      check_blocks(codes, scale, minimum, (name + " blocks' ").c_str(), k);
    Weight weight{data<const uint8_t>(codes), data<const float>(scale),
                  data<const float>(minimum), nullptr, n_out, max_block_rows,
                  block_panels ? 1 : 0};
    tensors.insert(tensors.end(), {codes, scale, minimum});
    place_with_panels(weight, panels, name, k);
  }

  // The last layer's next projection as QuantPanels (layers/gguf_blocks.py): its parts in
  // output order, each a GGUF type id (`formats`), codes, header and output count, serving up to
  // max_block_rows rows; then its panels, if any, serving more.
  void add_quant_projection(const std::vector<int64_t>& formats, const std::vector<Tensor>& codes,
                            const std::vector<Tensor>& headers, const std::vector<int64_t>& sizes,
                            int64_t max_block_rows, const std::optional<Tensor>& panels) {
    const size_t count = formats.size();
    TORCH_CHECK(count >= 1 && count <= kMaxQuantParts && codes.size() == count &&
                    headers.size() == count && sizes.size() == count,
                "formats, codes, headers and sizes must hold one entry per part (1 to ",
                kMaxQuantParts, "), got ", formats.size(), ", ", codes.size(), ", ",
                headers.size(), " and ", sizes.size());
    int64_t rows = 0;
    for (int64_t s : sizes) rows += s;
    int64_t n_out, k;
    const std::string name = next_projection(rows, max_block_rows, n_out, k);
    TORCH_CHECK(rows == n_out, name, "'s parts must have ", n_out, " outputs in all, got ", rows);
    Weight weight{nullptr, nullptr, nullptr, nullptr, n_out, max_block_rows, 0};
    for (size_t i = 0; i < count; ++i) {
      const std::string part = name + "'s part " + std::to_string(i) + " ";
      check_quant_panels(formats[i], codes[i], headers[i], part.c_str(), sizes[i], k);
      weight.quant.parts[i] = QuantPanel{formats[i], data<const uint8_t>(codes[i]),
                                         data<const uint8_t>(headers[i])};
      weight.quant.n_out[i] = sizes[i];
      tensors.insert(tensors.end(), {codes[i], headers[i]});
    }
    weight.quant.count = static_cast<int>(count);
    place_with_panels(weight, panels, name, k);
  }

  // The last layer's next projection on integer compute (int8_blocks.cpp), serving every row:
  // its parts in output order, each a GGUF type id, the file's bytes and its rows.
  void add_int8_projection(const std::vector<int64_t>& formats, const std::vector<Tensor>& blocks,
                           const std::vector<int64_t>& sizes) {
    TORCH_CHECK(formats.size() <= kMaxQuantParts, "at most ", kMaxQuantParts, " parts, got ",
                formats.size());
    int64_t rows = 0;
    for (int64_t s : sizes) rows += s;
    int64_t n_out, k;
    const std::string name = next_projection(rows, 0, n_out, k);
    TORCH_CHECK(rows == n_out, name, "'s parts must have ", n_out, " outputs in all, got ", rows);
    const std::vector<Int8BlockPart> parts =
        int8_block_parts(formats, blocks, sizes, k, name + "'s ");
    Weight weight{nullptr, nullptr, nullptr, nullptr, n_out, 0, 0};
    std::copy(parts.begin(), parts.end(), weight.int8_blocks);
    weight.int8_block_count = static_cast<int>(parts.size());
    tensors.insert(tensors.end(), blocks.begin(), blocks.end());
    place(weight);
  }

  // A blocks projection's panels serve the rows above its blocks' max_block_rows; without
  // panels the layers serve no more rows than the blocks do.
  void place_with_panels(Weight& weight, const std::optional<Tensor>& panels,
                         const std::string& name, int64_t k) {
    if (panels) {
      check_panels(*panels, (name + "'s panels").c_str(), dtype, weight.n_out, k);
      weight.panels = panels->data_ptr();
      tensors.push_back(*panels);
    } else if (max_rows_ < 0 || weight.max_block_rows < max_rows_) {
      max_rows_ = weight.max_block_rows;
    }
    place(weight);
  }

  void place(const Weight& weight) {
    LayerWeights& w = layers.back();
    Weight* slots[4] = {&w.qkv, &w.o, &w.gate_up, &w.down};
    *slots[projections_] = weight;
    ++projections_;
  }

  // Layer `layer`'s LoRA stacks (layers/lora.py), a and b per projection in qkv, o, gate_up,
  // down order: a [slots, rank, in] and b [slots, rank, out] float32, every layer's of one
  // number of slots. Held by reference: written in place, they serve every later call.
  void set_lora(int64_t layer, const std::vector<Tensor>& stacks) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "layer must be in 0..", num_layers() - 1,
                ", got ", layer);
    TORCH_CHECK(stacks.size() == 8, "stacks must hold a and b of 4 projections, got ",
                stacks.size(), " tensors");
    LayerWeights& w = layers[layer];
    const int64_t q_size = w.num_heads * w.head_dim;
    const int64_t sizes[4][2] = {{w.hidden, w.qkv.n_out}, {q_size, w.hidden},
                                 {w.hidden, 2 * w.intermediate}, {w.intermediate, w.hidden}};
    int64_t slots = lora_slots_;
    for (int p = 0; p < 4; ++p) {
      const std::string name = kProjections[p];
      const Tensor& a = stacks[2 * p];
      const Tensor& b = stacks[2 * p + 1];
      TORCH_CHECK(a.dim() == 3, name, "'s a must be 3-D [slots, rank, in], got shape ", a.sizes());
      if (slots < 0) slots = a.size(0);
      check_tensor(a, (name + "'s a").c_str(), at::kFloat, {slots, a.size(1), sizes[p][0]});
      check_tensor(b, (name + "'s b").c_str(), at::kFloat, {slots, a.size(1), sizes[p][1]});
    }
    TORCH_CHECK(slots > 0, "the stacks must hold at least one slot (slot 0: no adapter)");
    lora_slots_ = slots;
    for (int p = 0; p < 4; ++p)
      w.lora[p] = LoraStack{data<const float>(stacks[2 * p]), data<const float>(stacks[2 * p + 1]),
                            stacks[2 * p].size(1)};
    if (lora_tensors.size() < layers.size()) lora_tensors.resize(layers.size());
    lora_tensors[layer] = stacks;
  }

  int64_t max_rows() const { return max_rows_; }
  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }
  bool complete() const { return projections_ == 4; }
  bool has_lora() const {
    for (const LayerWeights& w : layers)
      if (!w.lora[0].a) return false;
    return !layers.empty();
  }

  std::vector<std::vector<Tensor>> lora_tensors;  // per layer, what set_lora took
  int64_t lora_slots_ = -1;  // the stacks' slots, once set
  int64_t projections_ = 4;  // the last layer's projections added so far
};

// One step of every layer: x, residual [rows, hidden]; cos[i], sin[i]: rotary table i, [rows,
// head_dim] or [rows, 1, head_dim] (a layer takes the table add_layer gave it); one K and V
// cache per layer; per KV-cache group g, slot_mapping[g], block_tables[g] and context_lens[g],
// layer l's group being layer_groups[l] (empty: every layer's group 0, the only one).
void decode_layers_op(const c10::intrusive_ptr<DecodeLayers>& weights, const Tensor& x,
                      const Tensor& residual, const std::vector<Tensor>& cos,
                      const std::vector<Tensor>& sin, const std::vector<Tensor>& k_caches,
                      const std::vector<Tensor>& v_caches, const std::vector<Tensor>& slot_mapping,
                      const std::vector<Tensor>& block_tables,
                      const std::vector<Tensor>& context_lens,
                      const std::vector<int64_t>& layer_groups,
                      const std::optional<Tensor>& lora_slots,
                      const std::vector<int64_t>& lora_widths) {
  const auto& layers = weights->layers;
  TORCH_CHECK(!layers.empty(), "weights holds no layers");
  TORCH_CHECK(weights->complete(), "the last layer of weights lacks projections");
  const LayerWeights& first = layers[0];
  const int64_t num_layers = weights->num_layers();
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [tokens, hidden], got shape ", x.sizes());
  const int64_t rows = x.size(0);
  check_tensor(x, "x", weights->dtype, {rows, first.hidden});
  TORCH_CHECK(weights->max_rows_ < 0 || rows <= weights->max_rows_, "x has ", rows,
              " rows, more than the weights serve (", weights->max_rows_, ")");
  check_tensor(residual, "residual", weights->dtype, {rows, first.hidden});
  TORCH_CHECK(!cos.empty() && sin.size() == cos.size(),
              "cos and sin need one table per rotary (at least one), got ", cos.size(), " and ",
              sin.size());
  for (size_t i = 0; i < cos.size(); ++i) {
    check_angles(cos[i], ("cos[" + std::to_string(i) + "]").c_str(), x, rows, first.head_dim);
    check_angles(sin[i], ("sin[" + std::to_string(i) + "]").c_str(), x, rows, first.head_dim);
  }
  for (int64_t l = 0; l < num_layers; ++l)
    TORCH_CHECK(layers[l].rotary < static_cast<int64_t>(cos.size()), "layer ", l,
                " takes rotary table ", layers[l].rotary, ", but cos and sin hold ", cos.size());
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers &&
                  v_caches.size() == k_caches.size(),
              "k_caches and v_caches need one cache per layer (", num_layers, "), got ",
              k_caches.size(), " and ", v_caches.size());
  const CacheShape c = check_caches(k_caches[0], v_caches[0], "k_caches[0]", "v_caches[0]");
  TORCH_CHECK(c.num_kv_heads == first.num_kv_heads && c.head_dim == first.head_dim,
              "k_caches[0] must have ", first.num_kv_heads, " KV heads of ", first.head_dim,
              ", got shape ", k_caches[0].sizes());
  for (size_t i = 0; i < k_caches.size(); ++i) {
    const std::string k_name = "k_caches[" + std::to_string(i) + "]";
    const std::string v_name = "v_caches[" + std::to_string(i) + "]";
    check_tensor(k_caches[i], k_name.c_str(), weights->dtype, k_caches[0].sizes());
    check_tensor(v_caches[i], v_name.c_str(), weights->dtype, k_caches[0].sizes());
  }
  const size_t groups = slot_mapping.size();
  TORCH_CHECK(groups >= 1 && block_tables.size() == groups && context_lens.size() == groups,
              "slot_mapping, block_tables and context_lens need one tensor per KV-cache group "
              "(at least one), got ", slot_mapping.size(), ", ", block_tables.size(), " and ",
              context_lens.size());
  TORCH_CHECK(layer_groups.empty() ? groups == 1
                                   : static_cast<int64_t>(layer_groups.size()) == num_layers,
              "layer_groups must give each layer's KV-cache group (", num_layers,
              " layers; empty: one group), got ", layer_groups.size(), " for ", groups,
              " groups");
  std::vector<int64_t> group_of(num_layers, 0);
  for (int64_t l = 0; l < static_cast<int64_t>(layer_groups.size()); ++l) {
    TORCH_CHECK(layer_groups[l] >= 0 && layer_groups[l] < static_cast<int64_t>(groups),
                "layer_groups[", l, "] = ", layer_groups[l], " is not a group (", groups,
                " groups)");
    group_of[l] = layer_groups[l];
  }
  for (size_t g = 0; g < groups; ++g) {
    // Blocks before a window are never read: check those that the group's widest window reads.
    int64_t widest = -1;
    for (int64_t l = 0; l < num_layers; ++l) {
      if (group_of[l] != static_cast<int64_t>(g)) continue;
      const int64_t window = layers[l].window;
      widest = window == 0 || widest == 0 ? 0 : std::max(widest, window);
    }
    try {
      check_indices(c, rows, block_tables[g], context_lens[g], std::nullopt, slot_mapping[g],
                    std::max<int64_t>(widest, 0));
    } catch (const c10::Error& e) {
      if (groups == 1) throw;
      TORCH_CHECK(false, "KV-cache group ", g, ": ", e.msg());
    }
  }
  LoraStep lora;
  if (lora_slots) {
    TORCH_CHECK(weights->has_lora(), "lora_slots given, but weights holds no LoRA stacks "
                "(set_lora)");
    check_tensor(*lora_slots, "lora_slots", at::kInt, {rows});
    lora.slots = data<const int32_t>(*lora_slots);
    lora.num_slots = weights->lora_slots_;
    for (int64_t t = 0; t < rows; ++t)
      TORCH_CHECK(lora.slots[t] >= 0 && lora.slots[t] < lora.num_slots, "lora_slots[", t,
                  "] = ", lora.slots[t], " is not a slot of the stacks (", lora.num_slots,
                  " slots)");
    TORCH_CHECK(static_cast<int64_t>(lora_widths.size()) == 4 * num_layers,
                "lora_widths needs 4 widths per layer (", 4 * num_layers, "), got ",
                lora_widths.size());
    for (size_t i = 0; i < lora_widths.size(); ++i)
      TORCH_CHECK(lora_widths[i] >= 0 && lora_widths[i] <= layers[i / 4].lora[i % 4].rank,
                  "lora_widths[", i, "] must be in 0..", layers[i / 4].lora[i % 4].rank,
                  " (its stacks' rank), got ", lora_widths[i]);
  }
  with_type(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    Activations<T> activations(first, rows);
    // Layer i's output overwrites x, layer i + 1's input: each layer reads its input only in
    // its first norm and writes its output only at its end.
    for (int64_t i = 0; i < num_layers; ++i) {
      const LayerWeights& w = layers[i];
      const int64_t g = group_of[i];
      const LayerStep<T> step{data<const T>(cos[w.rotary]), data<const T>(sin[w.rotary]),
                              data<const int64_t>(slot_mapping[g]),
                              data<const int32_t>(block_tables[g]),
                              data<const int32_t>(context_lens[g]), block_tables[g].size(1)};
      decode_layer<T>(&w, data<T>(x), data<const T>(x), data<T>(residual), rows, step,
                      data<T>(k_caches[i]), data<T>(v_caches[i]), c.block_size, activations,
                      threads(),
                      lora.slots ? LoraStep{lora.slots, lora_widths.data() + 4 * i, lora.num_slots}
                                 : lora);
    }
  });
}

}  // namespace CONVEYOR_OPS_NAMESPACE

TORCH_LIBRARY_FRAGMENT(CONVEYOR_OPS_NAMESPACE, m) {
  using CONVEYOR_OPS_NAMESPACE::DecodeLayers;
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<>())
      .def("add_layer", &DecodeLayers::add_layer, "",
           {torch::arg("input_norm"), torch::arg("post_norm"), torch::arg("num_heads"),
            torch::arg("num_kv_heads"), torch::arg("head_dim"), torch::arg("eps"),
            torch::arg("window") = 0, torch::arg("q_norm") = c10::IValue(),
            torch::arg("k_norm") = c10::IValue(),
            torch::arg("post_attention_norm") = c10::IValue(),
            torch::arg("post_feedforward_norm") = c10::IValue(),
            torch::arg("activation") = "silu", torch::arg("scale") = c10::IValue(),
            torch::arg("rotary") = 0})
      .def("add_projection", &DecodeLayers::add_projection)
      .def("add_quant_projection", &DecodeLayers::add_quant_projection)
      .def("add_int8_projection", &DecodeLayers::add_int8_projection)
      .def("set_lora", &DecodeLayers::set_lora)
      .def("has_lora", &DecodeLayers::has_lora)
      .def("max_rows", &DecodeLayers::max_rows)
      .def("num_layers", &DecodeLayers::num_layers);
  m.def("decode_layers(__torch__.torch.classes." CONVEYOR_NAME(CONVEYOR_OPS_NAMESPACE)
        ".DecodeLayers weights, Tensor(a!) x, Tensor(b!) residual, "
        "Tensor[] cos, Tensor[] sin, Tensor(c!)[] k_caches, Tensor(d!)[] v_caches, "
        "Tensor[] slot_mapping, Tensor[] block_tables, Tensor[] context_lens, "
        "int[] layer_groups=[], Tensor? lora_slots=None, "
        "int[] lora_widths=[]) -> ()",
        &CONVEYOR_OPS_NAMESPACE::decode_layers_op);
}

// A CPU step's decoder layers in one call (serve/cpu_layers.py binds them once, runs them each step).
//
// A layer is ~15 calls: RMSNorm with the residual add, the fused q/k/v linear, rotary, the KV
// write, paged attention, the o projection, RMSNorm, the fused gate/up linear, SwiGLU (one call
// with it where Baton's GEMM applies SwiGLU as it stores: gemm_swiglu), the down projection, and
// the slices between them. Made from Python, each pays the interpreter, pybind's
// or torch.ops' argument parsing and a tensor view or two (~55 us a layer on the 25M serving model,
// 2 cores): at a batch-64 decode step that is a few per cent of the step, at batch 1 more. Here the
// same kernels run in the same order on the same arguments, so the result is bit for bit the
// Python loop's (and the modules'). The GIL is released for the whole stack: a server's threads
// keep answering while a step runs.
//
// A linear is one of the kinds kernels/linear_cpu.py packs: Baton's GEMM (gemm_cpu.cpp), oneDNN's
// blocked weight (the bare mkldnn::_linear_pointwise op, through the dispatcher), MKL's packed SGEMM
// (cblas_sgemm_compute, whose address libtorch_cpu exports; x widened to float32 and the result
// rounded back, as packed_linear does) or a plain weight (at::linear, F.linear's op).
#include "cpu_kernels.h"

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

// cblas_sgemm_compute(layout, transa, transb, m, n, k, a, lda, b, ldb, beta, c, ldc): MKL_INT is
// 32-bit in torch's LP64 MKL, the enums are ints (mkl_cblas.h).
using SgemmCompute = void (*)(int, int, int, int, int, int, const float*, int, const float*, int, float, float*, int);
constexpr int kRowMajor = 101, kNoTrans = 111, kPacked = 151;

const auto& linear_pointwise() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op;
}

}  // namespace

// One linear layer as kernels/linear_cpu.py left it: x [rows, in] -> [rows, out].
struct CpuLinear {
  std::string kind;  // "baton", "onednn", "mkl" or "plain"
  torch::Tensor weight;  // gemm_pack's panels, oneDNN's opaque tensor, MKL's packed buffer (never moved) or the plain [out, in]
  std::optional<torch::Tensor> bias;
  int64_t out_features, in_features;
  SgemmCompute sgemm = nullptr;

  CpuLinear(std::string kind_, torch::Tensor weight_, std::optional<torch::Tensor> bias_, int64_t out, int64_t in,
            int64_t sgemm_address)
      : kind(std::move(kind_)), weight(std::move(weight_)), bias(std::move(bias_)), out_features(out),
        in_features(in), sgemm(reinterpret_cast<SgemmCompute>(sgemm_address)) {
    TORCH_CHECK(kind == "baton" || kind == "onednn" || kind == "plain" || (kind == "mkl" && sgemm != nullptr),
                "CpuLinear: kind 'baton', 'onednn', 'plain' or 'mkl' (with cblas_sgemm_compute's address), got '", kind,
                "'");
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind == "baton") return gemm_linear(x, weight, bias, out_features);
    if (kind == "onednn")
      return linear_pointwise().call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
    if (kind == "plain") return at::linear(x, weight, bias);
    const auto x2 = x.to(torch::kFloat32).contiguous();  // MKL: float32 in, one rounding to x's dtype out
    auto y = torch::empty({x2.size(0), out_features}, x2.options());
    if (y.numel()) {
      RECORD_FUNCTION("baton::packed_sgemm", std::vector<c10::IValue>());
      sgemm(kRowMajor, kNoTrans, kPacked, x2.size(0), out_features, in_features, x2.data_ptr<float>(), in_features,
            weight.data_ptr<float>(), in_features, 0.f, y.data_ptr<float>(), out_features);
    }
    if (bias) y.add_(*bias);
    return y.to(x.scalar_type());
  }
};

struct CpuDecoderLayer {
  torch::Tensor norm_in, norm_post;
  double eps_in, eps_post;
  CpuLinear qkv, o, gate_up, down;
  int64_t heads, kv_heads, head_dim, intermediate;
  double scale;
  int64_t window;  // 0: none
  torch::Tensor k_cache, v_cache;
  bool fused_swiglu;  // Baton's GEMM computes silu(gate) * up in its epilogue (gemm_swiglu)
};

// The bound layers of one runner; run() takes any of them, in the order given.
class CpuDecoderLayers {
 public:
  int64_t add(torch::Tensor norm_in, double eps_in, torch::Tensor norm_post, double eps_post, CpuLinear qkv,
              CpuLinear o, CpuLinear gate_up, CpuLinear down, int64_t heads, int64_t kv_heads, int64_t head_dim,
              int64_t intermediate, double scale, int64_t window, torch::Tensor k_cache, torch::Tensor v_cache) {
    layers_.push_back({std::move(norm_in), std::move(norm_post), eps_in, eps_post, std::move(qkv), std::move(o),
                       std::move(gate_up), std::move(down), heads, kv_heads, head_dim, intermediate, scale, window,
                       std::move(k_cache), std::move(v_cache), false});
    auto& l = layers_.back();
    l.fused_swiglu = l.gate_up.kind == "baton" && gemm_swiglu_fits(l.gate_up.weight, intermediate);
    return static_cast<int64_t>(layers_.size()) - 1;
  }

  // h [T, hidden] through layers `ids`; every row is one query over its sequence's cache up to
  // itself (tables/lens: AttentionMetadata.rows_over_cache, or the decode rows'). The residual is
  // carried between layers so that the next layer's input norm does the add in its one pass.
  torch::Tensor run(torch::Tensor h, const std::vector<int64_t>& ids, torch::Tensor cos, torch::Tensor sin,
                    torch::Tensor tables, torch::Tensor lens, torch::Tensor slot_mapping, bool window_in_cache) const {
    const int64_t t = h.size(0);
    torch::Tensor res, out, y;  // res: the residual stream; out: the last layer's output, not yet added
    for (const int64_t id : ids) {
      TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(layers_.size()), "no bound layer ", id);
      const CpuDecoderLayer& l = layers_[id];
      if (!res.defined()) {
        res = h;
        y = std::get<0>(rms_norm(h, l.norm_in, l.eps_in, std::nullopt));
      } else {
        std::tie(y, res) = rms_norm(out, l.norm_in, l.eps_in, res);  // res + out, the previous layer's sum
      }
      const int64_t d = l.head_dim, hq = l.heads * d, hk = l.kv_heads * d;
      const auto qkv = l.qkv(y);
      auto [q, k] = rotary(qkv.slice(1, 0, hq).view({t, l.heads, d}),
                           qkv.slice(1, hq, hq + hk).view({t, l.kv_heads, d}), cos, sin);
      const auto v = qkv.slice(1, hq + hk).view({t, l.kv_heads, d});
      cache_write(k, v, l.k_cache, l.v_cache, slot_mapping);
      const auto a = paged_decode(q, l.k_cache, l.v_cache, tables, lens, l.scale, window_in_cache ? l.window : 0,
                                  std::nullopt);
      std::tie(y, res) = rms_norm(l.o(a.view({t, hq})), l.norm_post, l.eps_post, res);
      if (l.fused_swiglu) {
        out = l.down(gemm_swiglu(y, l.gate_up.weight, l.gate_up.bias, l.intermediate));
      } else {
        const auto gu = l.gate_up(y);
        out = l.down(swiglu(gu.slice(1, 0, l.intermediate), gu.slice(1, l.intermediate)));
      }
    }
    return res.defined() ? res + out : h;
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  bool fuses_swiglu(int64_t id) const { return layers_.at(id).fused_swiglu; }

  const CpuLinear& linear(int64_t id, const std::string& name) const {
    const auto& l = layers_.at(id);
    if (name == "qkv") return l.qkv;
    if (name == "o") return l.o;
    if (name == "gate_up") return l.gate_up;
    TORCH_CHECK(name == "down", "no linear '", name, "': qkv, o, gate_up or down");
    return l.down;
  }

 private:
  std::vector<CpuDecoderLayer> layers_;
};

void bind_decoder(py::module_& m) {
  py::class_<CpuLinear>(m, "CpuLinear", py::module_local(), "one packed (or plain) linear layer, as the decoder stack calls it")
      .def(py::init<std::string, torch::Tensor, std::optional<torch::Tensor>, int64_t, int64_t, int64_t>(),
           py::arg("kind"), py::arg("weight"), py::arg("bias"), py::arg("out_features"), py::arg("in_features"),
           py::arg("sgemm_address") = 0)
      .def_readonly("kind", &CpuLinear::kind)
      .def("__call__", &CpuLinear::operator(), py::arg("x"));
  py::class_<CpuDecoderLayers>(m, "CpuDecoderLayers", py::module_local(), "a runner's decoder layers, bound once, run each step")
      .def(py::init<>())
      .def("add", &CpuDecoderLayers::add, "bind one layer; returns its id", py::arg("norm_in"), py::arg("eps_in"),
           py::arg("norm_post"), py::arg("eps_post"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("scale"), py::arg("window"), py::arg("k_cache"), py::arg("v_cache"))
      .def("run", &CpuDecoderLayers::run, "h [T, hidden] through the layers `ids`, in order",
           py::arg("h"), py::arg("ids"), py::arg("cos"), py::arg("sin"), py::arg("tables"), py::arg("lens"),
           py::arg("slot_mapping"), py::arg("window_in_cache"), py::call_guard<py::gil_scoped_release>())
      .def("fuses_swiglu", &CpuDecoderLayers::fuses_swiglu, "whether layer `id`'s gate/up GEMM applies SwiGLU itself",
           py::arg("id"))
      .def("linear", &CpuDecoderLayers::linear, py::arg("id"), py::arg("name"), py::return_value_policy::copy)
      .def("__len__", &CpuDecoderLayers::size);
}

#include "torch/params.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>

namespace moeext::torch_glue {

DType to_moeext_dtype(const at::Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK(false, op, ": ", arg, " must be float32, bfloat16 or float16, got ",
                  t.scalar_type());
  }
}

namespace {

ScoringFunc parse_scoring_func(std::string_view name, const char* op) {
  if (name == "sigmoid") return ScoringFunc::kSigmoid;
  if (name == "sqrtsoftplus") return ScoringFunc::kSqrtSoftplus;
  if (name == "softmax") return ScoringFunc::kSoftmax;
  TORCH_CHECK(false, op, ": scoring_func must be 'sigmoid', 'sqrtsoftplus' or 'softmax', got '",
              name, "'");
}

// The bytes a view covers, as rows along its dim 0: row r is the range
// [begin + r * stride, begin + r * stride + width), stride in bytes (torch strides are never
// negative). A row with strided columns is described by its first to last byte.
struct RowBytes {
  uintptr_t begin = 0;
  int64_t stride = 0;
  int64_t width = 0;
  int64_t rows = 0;
};

// `rows` rows of `cols` elements of `element` bytes, strides in elements.
RowBytes rows_of(const void* data, int64_t rows, int64_t row_stride, int64_t cols,
                 int64_t col_stride, int64_t element) {
  RowBytes r;
  r.begin = reinterpret_cast<uintptr_t>(data);
  r.stride = row_stride * element;
  r.width = rows == 0 || cols == 0 ? 0 : ((cols - 1) * col_stride + 1) * element;
  r.rows = rows;
  return r;
}

int64_t element_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

bool rows_overlap_each_other(const RowBytes& a) {
  return a.rows > 1 && a.width > 0 && a.stride < a.width;
}

int64_t floor_div(int64_t x, int64_t d) { return x >= 0 ? x / d : -((-x + d - 1) / d); }

// Exact for the row sets above. Separate buffers end at the first test. Views into one
// workspace with one row stride s (the usual case) are solved directly: row i of a and row j
// of b overlap iff d - a.width < (i - j) * s < d + b.width, with d = b.begin - a.begin.
// Otherwise the rows are walked in address order on both sides, advancing whichever row
// ends first (a row that ends before the other's starts cannot meet any later one).
bool rows_overlap(RowBytes a, RowBytes b) {
  if (a.rows == 0 || b.rows == 0 || a.width == 0 || b.width == 0) return false;
  if (a.stride == 0) a.rows = 1;
  if (b.stride == 0) b.rows = 1;
  const uintptr_t a_end = a.begin + uintptr_t((a.rows - 1) * a.stride + a.width);
  const uintptr_t b_end = b.begin + uintptr_t((b.rows - 1) * b.stride + b.width);
  if (a_end <= b.begin || b_end <= a.begin) return false;
  if (a.stride == b.stride && a.rows > 1 && b.rows > 1) {
    const int64_t s = a.stride;
    const int64_t d = int64_t(b.begin - a.begin);
    const int64_t k_min = std::max(floor_div(d - a.width, s) + 1, 1 - b.rows);
    const int64_t k_max = std::min(-floor_div(-(d + b.width), s) - 1, a.rows - 1);
    return k_min <= k_max;
  }
  for (int64_t i = 0, j = 0; i < a.rows && j < b.rows;) {
    const uintptr_t a_lo = a.begin + uintptr_t(i * a.stride), a_hi = a_lo + uintptr_t(a.width);
    const uintptr_t b_lo = b.begin + uintptr_t(j * b.stride), b_hi = b_lo + uintptr_t(b.width);
    if (a_lo < b_hi && b_lo < a_hi) return true;
    if (a_hi <= b_hi) {
      ++i;
    } else {
      ++j;
    }
  }
  return false;
}

// Writes into memory that a read or another write also covers would make the result depend
// on the order the kernel happens to touch it in: refused, as torch's out= ops refuse it.
// Read from the filled params, so the common case (separate buffers) costs a few compares.
void check_grouped_topk_outputs_apart(const BiasedGroupedTopkParams& p, const char* op) {
  const RowBytes weights =
      rows_of(p.topk_weights, p.num_tokens, p.weights_row_stride, p.topk, 1, 4);
  const RowBytes ids = rows_of(p.topk_ids, p.num_tokens, p.ids_row_stride, p.topk, 1, 4);
  const RowBytes logits = rows_of(p.gating_output, p.num_tokens, p.gating_row_stride,
                                  p.num_experts, p.gating_col_stride, element_size(p.gating_dtype));
  // The bias as one row per expert (a broadcast stride 0 is one element).
  const RowBytes bias = rows_of(p.correction_bias, p.correction_bias ? p.num_experts : 0,
                                p.bias_stride, 1, 1, element_size(p.bias_dtype));
  for (const auto& [out, name] : {std::pair{&weights, "topk_weights"}, {&ids, "topk_ids"}}) {
    TORCH_CHECK(!rows_overlap_each_other(*out), op, ": ", name,
                " has rows that share memory (row stride ", out->stride / 4, " < topk ", p.topk,
                "); every row needs its own");
  }
  const char* clash = rows_overlap(weights, ids)      ? "topk_weights and topk_ids"
                      : rows_overlap(weights, logits) ? "topk_weights and gating_output"
                      : rows_overlap(ids, logits)     ? "topk_ids and gating_output"
                      : rows_overlap(weights, bias)   ? "topk_weights and correction_bias"
                      : rows_overlap(ids, bias)       ? "topk_ids and correction_bias"
                                                      : nullptr;
  TORCH_CHECK(clash == nullptr, op, ": ", clash,
              " share memory; the outputs must not overlap the inputs or each other");
}

void check_output(const at::Tensor& out, const at::Tensor& gating_output, at::ScalarType dtype,
                  int64_t topk, const char* op, const char* arg) {
  TORCH_CHECK(out.dim() == 2, op, ": ", arg, " must be 2-D [num_tokens, topk], got ", out.dim(),
              "-D");
  TORCH_CHECK(out.scalar_type() == dtype, op, ": ", arg, " must be ", dtype, ", got ",
              out.scalar_type());
  TORCH_CHECK(out.device() == gating_output.device(), op, ": ", arg, " is on ", out.device(),
              " but gating_output is on ", gating_output.device());
  TORCH_CHECK(out.size(0) == gating_output.size(0) && out.size(1) == topk, op, ": ", arg,
              " must have shape [", gating_output.size(0), ", ", topk, "], got ", out.sizes());
  TORCH_CHECK(out.size(1) <= 1 || out.stride(1) == 1, op, ": ", arg,
              " must have contiguous columns (stride(1) == 1; rows may be strided), got strides ",
              out.strides());
}

}  // namespace

ScoringFunc check_grouped_topk_inputs(const at::Tensor& gating_output,
                                      const std::optional<at::Tensor>& correction_bias,
                                      int64_t num_expert_group, int64_t topk_group,
                                      int64_t topk, std::string_view scoring_func,
                                      const char* op) {
  TORCH_CHECK(gating_output.dim() == 2, op,
              ": gating_output must be 2-D [num_tokens, num_experts], got shape ",
              gating_output.sizes());
  to_moeext_dtype(gating_output, op, "gating_output");
  const int64_t num_experts = gating_output.size(1);
  TORCH_CHECK(num_experts <= std::numeric_limits<int32_t>::max(), op,
              ": num_experts must fit int32 expert ids, got ", num_experts);
  TORCH_CHECK(num_expert_group >= 1, op, ": num_expert_group must be >= 1, got ",
              num_expert_group);
  TORCH_CHECK(num_experts % num_expert_group == 0, op, ": num_expert_group (",
              num_expert_group, ") must divide the number of experts (", num_experts, ")");
  TORCH_CHECK(topk_group >= 1 && topk_group <= num_expert_group, op,
              ": topk_group must be in [1, num_expert_group = ", num_expert_group, "], got ",
              topk_group);
  const int64_t per_group = num_experts / num_expert_group;
  TORCH_CHECK(topk >= 1, op, ": topk must be >= 1, got ", topk);
  TORCH_CHECK(topk <= topk_group * per_group, op, ": topk (", topk,
              ") exceeds the experts in the kept groups (topk_group ", topk_group, " x ",
              per_group, " per group)");
  if (correction_bias.has_value()) {
    const at::Tensor& bias = *correction_bias;
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == num_experts, op,
                ": correction_bias must have shape [", num_experts, "], got ", bias.sizes());
    to_moeext_dtype(bias, op, "correction_bias");
    TORCH_CHECK(bias.device() == gating_output.device(), op, ": correction_bias is on ",
                bias.device(), " but gating_output is on ", gating_output.device());
  }
  return parse_scoring_func(scoring_func, op);
}

BiasedGroupedTopkParams make_grouped_topk_params(
    const at::Tensor& gating_output, const std::optional<at::Tensor>& correction_bias,
    const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t num_expert_group,
    int64_t topk_group, bool renormalize, double routed_scaling_factor,
    std::string_view scoring_func, const char* op) {
  TORCH_CHECK(topk_ids.dim() == 2, op, ": topk_ids must be 2-D [num_tokens, topk], got ",
              topk_ids.dim(), "-D");
  const int64_t topk = topk_ids.size(1);
  const ScoringFunc scoring = check_grouped_topk_inputs(
      gating_output, correction_bias, num_expert_group, topk_group, topk, scoring_func, op);
  check_output(topk_weights, gating_output, at::kFloat, topk, op, "topk_weights");
  check_output(topk_ids, gating_output, at::kInt, topk, op, "topk_ids");
  const BiasedGroupedTopkParams p =
      fill_grouped_topk_params(gating_output, correction_bias, topk_weights, topk_ids,
                               num_expert_group, topk_group, renormalize,
                               routed_scaling_factor, scoring);
  check_grouped_topk_outputs_apart(p, op);
  return p;
}

BiasedGroupedTopkParams fill_grouped_topk_params(
    const at::Tensor& gating_output, const std::optional<at::Tensor>& correction_bias,
    const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t num_expert_group,
    int64_t topk_group, bool renormalize, double routed_scaling_factor, ScoringFunc scoring) {
  constexpr const char* op = "biased_grouped_topk";  // dtypes were checked: cannot fail
  BiasedGroupedTopkParams p;
  p.scoring_func = scoring;
  p.gating_output = gating_output.data_ptr();
  p.gating_dtype = to_moeext_dtype(gating_output, op, "gating_output");
  p.gating_row_stride = gating_output.stride(0);
  p.gating_col_stride = gating_output.stride(1);
  if (correction_bias.has_value()) {
    p.correction_bias = correction_bias->data_ptr();
    p.bias_dtype = to_moeext_dtype(*correction_bias, op, "correction_bias");
    p.bias_stride = correction_bias->stride(0);
  }
  p.topk_weights = topk_weights.data_ptr<float>();
  p.weights_row_stride = topk_weights.stride(0);
  p.topk_ids = topk_ids.data_ptr<int32_t>();
  p.ids_row_stride = topk_ids.stride(0);
  p.num_tokens = gating_output.size(0);
  p.num_experts = gating_output.size(1);
  p.num_expert_group = num_expert_group;
  p.topk_group = topk_group;
  p.topk = topk_ids.size(1);
  p.renormalize = renormalize;
  p.routed_scaling_factor = static_cast<float>(routed_scaling_factor);
  return p;
}

int64_t router_gemm_num_experts(const at::Tensor& weight) {
  return weight.dim() == 3 ? weight.size(1) : weight.size(0);
}

at::ScalarType check_router_gemm_inputs(const at::Tensor& hidden_states, const at::Tensor& weight,
                                        std::optional<at::ScalarType> out_dtype, const char* op) {
  TORCH_CHECK(hidden_states.dim() == 2, op,
              ": hidden_states must be 2-D [num_tokens, hidden_size], got shape ",
              hidden_states.sizes());
  to_moeext_dtype(hidden_states, op, "hidden_states");
  const int64_t hidden_size = hidden_states.size(1);
  if (weight.dim() == 3) {
    const int64_t pairs = (hidden_size + 1) / 2;
    TORCH_CHECK(hidden_states.scalar_type() == at::kBFloat16 &&
                    weight.scalar_type() == at::kBFloat16,
                op, ": a prepacked weight and hidden_states must both be bfloat16, got weight ",
                weight.scalar_type(), " and hidden_states ", hidden_states.scalar_type());
    TORCH_CHECK(weight.size(0) == pairs && weight.size(2) == 2, op,
                ": a prepacked weight must have shape [", pairs,
                ", num_experts, 2] (ceil(hidden_size / 2) for the hidden_size ", hidden_size,
                " of hidden_states), got ", weight.sizes());
    TORCH_CHECK(weight.is_contiguous(), op,
                ": a prepacked weight must be contiguous, as moeext.prepack_router_weight "
                "returns it, got strides ",
                weight.strides());
  } else {
    TORCH_CHECK(weight.dim() == 2, op,
                ": weight must be 2-D [num_experts, hidden_size] (or prepacked, 3-D "
                "[ceil(hidden_size / 2), num_experts, 2]), got shape ",
                weight.sizes());
    TORCH_CHECK(weight.scalar_type() == hidden_states.scalar_type(), op,
                ": weight must have the dtype of hidden_states (", hidden_states.scalar_type(),
                "), got ", weight.scalar_type());
    TORCH_CHECK(weight.size(1) == hidden_size, op, ": weight must have shape [num_experts, ",
                hidden_size, "] (hidden_size of hidden_states), got ", weight.sizes());
    TORCH_CHECK(weight.size(1) <= 1 || weight.stride(1) == 1, op,
                ": weight must have contiguous rows (stride(1) == 1), got strides ",
                weight.strides());
  }
  TORCH_CHECK(weight.device() == hidden_states.device(), op, ": weight is on ", weight.device(),
              " but hidden_states is on ", hidden_states.device());
  // Strided rows (a slice of a wider activation buffer) are fine; strided columns would make
  // every load a gather, and a per-call copy is what this op exists to avoid.
  TORCH_CHECK(hidden_size <= 1 || hidden_states.stride(1) == 1, op,
              ": hidden_states must have contiguous rows (stride(1) == 1), got strides ",
              hidden_states.strides());
  const at::ScalarType logits_dtype = out_dtype.value_or(at::kFloat);
  TORCH_CHECK(logits_dtype == at::kFloat || logits_dtype == at::kBFloat16, op,
              ": out_dtype must be float32 or bfloat16 (or None for float32), got ",
              logits_dtype);
  return logits_dtype;
}

RouterGemmParams make_router_gemm_params(const at::Tensor& hidden_states,
                                         const at::Tensor& weight, const at::Tensor& logits) {
  RouterGemmParams p;
  p.hidden_states = hidden_states.data_ptr();
  p.hidden_row_stride = hidden_states.stride(0);
  p.weight = weight.data_ptr();
  p.weight_prepacked = weight.dim() == 3;
  p.weight_row_stride = p.weight_prepacked ? 0 : weight.stride(0);
  p.input_dtype = to_moeext_dtype(hidden_states, "router_gemm", "hidden_states");
  p.logits = logits.data_ptr();
  p.logits_row_stride = logits.stride(0);
  p.logits_dtype = to_moeext_dtype(logits, "router_gemm", "out_dtype");
  p.num_tokens = hidden_states.size(0);
  p.hidden_size = hidden_states.size(1);
  p.num_experts = router_gemm_num_experts(weight);
  return p;
}

ZeroRowsParams make_zero_tail_params(const at::Tensor& buf, int64_t new_extent,
                                     int64_t prev_extent, const char* op,
                                     const at::Tensor* state) {
  TORCH_CHECK(new_extent >= 0, op, ": new_extent must be >= 0, got ", new_extent);
  TORCH_CHECK(prev_extent >= 0, op, ": prev_extent must be >= 0, got ", prev_extent);
  TORCH_CHECK(buf.dim() >= 1, op, ": buf must have at least one dimension, got a 0-d tensor");
  // Rows (everything past dim 0) must be dense so a row is one byte range.
  int64_t expected = 1;
  for (int64_t d = buf.dim() - 1; d >= 1; --d) {
    TORCH_CHECK(buf.size(d) == 1 || buf.stride(d) == expected, op,
                ": buf must have contiguous rows (any stride along dim 0), got sizes ",
                buf.sizes(), " and strides ", buf.strides());
    expected *= buf.size(d);
  }
  const int64_t rows = buf.size(0);
  const int64_t row_bytes = expected * int64_t(buf.element_size());
  const RowBytes buf_rows = rows_of(buf.data_ptr(), rows, buf.stride(0) * buf.element_size(),
                                    row_bytes, 1, 1);
  TORCH_CHECK(!rows_overlap_each_other(buf_rows), op,
              ": buf has rows that share memory (stride(0) ", buf.stride(0), " < ", expected,
              " elements per row); zeroing one row would zero others");
  if (state != nullptr) {
    TORCH_CHECK(!rows_overlap(buf_rows, rows_of(state->data_ptr(), 1, 1, 1, 1, 8)), op,
                ": state shares memory with buf; it must be a tensor of its own");
  }
  ZeroRowsParams p;
  p.data = buf.data_ptr();
  p.row_bytes = row_bytes;
  p.row_stride = buf.stride(0) * int64_t(buf.element_size());
  p.row_begin = std::min(new_extent, rows);
  p.row_end = std::min(prev_extent, rows);
  return p;
}

void check_zero_tail_state(const at::Tensor& buf, const at::Tensor& state, const char* op) {
  TORCH_CHECK(state.scalar_type() == at::kLong && state.numel() == 1, op,
              ": state must hold one int64 (the previous extent), got ", state.scalar_type(),
              " with ", state.numel(), " elements");
  TORCH_CHECK(state.device() == buf.device(), op, ": state is on ", state.device(),
              " but buf is on ", buf.device());
}

namespace {

// The one stride, in elements, that steps through t's leading dims [..., N, K] flattened to
// [B, N, K], or none where no single stride does. Dims of size 1 are passed over: torch leaves
// their strides arbitrary and counts a tensor contiguous whatever they are, so its contiguous()
// returns such a view as it is, and reading the batch stride off dim -3 stepped out of the
// tensor's memory for [2, 1, N, K] views of a [1, 2, N, K] tensor.
std::optional<int64_t> flat_batch_stride(const at::Tensor& t) {
  std::optional<int64_t> stride;  // of the innermost leading dim of size > 1
  int64_t outer = 0;              // the stride the next such dim out must have
  for (int64_t d = t.dim() - 3; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (stride && t.stride(d) != outer) return std::nullopt;
    if (!stride) stride = t.stride(d);
    outer = t.stride(d) * t.size(d);
  }
  return stride.value_or(0);  // one batch at most: its stride is never used
}

}  // namespace

ShuffleWeightParams make_shuffle_weight_params(const at::Tensor& logical, void* shuffled,
                                               at::IntArrayRef layout, bool gate_up,
                                               const char* op) {
  TORCH_CHECK(logical.dim() >= 2, op, ": w must be at least 2-D [..., N, K], got shape ",
              logical.sizes());
  const int64_t element = logical.element_size();
  TORCH_CHECK((element == 1 || element == 2) && !logical.is_complex(), op,
              ": w must have a 1- or 2-byte dtype (uint8, int8, fp8, float4_e2m1fn_x2, "
              "bfloat16, float16), got ", logical.scalar_type());
  TORCH_CHECK(layout.size() == 2, op, ": layout must be (IN, IK), got ", layout);
  const int64_t band = layout[0], ik = layout[1];
  const int64_t chunk = 16 / element;  // elements in a 16-byte chunk
  TORCH_CHECK(band >= 1 && band <= kMaxShuffleBand, op,
              ": layout[0] (rows per band) must be in [1, ", kMaxShuffleBand, "], got ", band);
  // 2 * ik is never formed: a layout[1] near 2^63 would wrap it into a divisor of K.
  TORCH_CHECK(ik >= 1 && ik % (chunk / 2) == 0, op, ": layout[1] (", ik,
              ") must make 2 * layout[1] a multiple of ", chunk, " elements (16 bytes of ",
              logical.scalar_type(), ")");
  const int64_t rows = logical.size(-2), k = logical.size(-1);
  TORCH_CHECK(rows % band == 0, op, ": N (", rows, ") must be a multiple of layout[0] (", band,
              ")");
  TORCH_CHECK(k % ik == 0 && (k / ik) % 2 == 0, op, ": K (", k,
              ") must be a multiple of 2 * layout[1] (2 x ", ik, ")");
  if (gate_up) {
    TORCH_CHECK(logical.dim() == 3, op,
                ": gate_up=True needs a 3-D fused weight [E, 2N, K], got shape ",
                logical.sizes());
    TORCH_CHECK(rows % 32 == 0, op, ": gate_up=True needs 2N (", rows,
                ") to be a multiple of 32 (16-row gate/up blocks)");
  }
  // An empty w reads nothing, and torch's contiguous() returns empty views as they are.
  TORCH_CHECK(logical.stride(-1) == 1 || logical.numel() == 0, op,
              ": w must have a contiguous last dimension (stride 1), got strides ",
              logical.strides());
  // shuffle_weight_source's tensor or a new one: one batch stride, unless w is empty.
  const std::optional<int64_t> batch_stride = flat_batch_stride(logical);
  TORCH_INTERNAL_ASSERT(batch_stride.has_value() || logical.numel() == 0);
  ShuffleWeightParams p;
  p.logical = logical.data_ptr();
  p.shuffled = shuffled;
  p.rows = rows;
  p.row_bytes = k * element;
  p.band = band;
  p.gate_up = gate_up;
  p.logical_row_stride = logical.stride(-2) * element;
  p.batch = 1;
  for (int64_t d = 0; d + 2 < logical.dim(); ++d) p.batch *= logical.size(d);
  p.logical_batch_stride = batch_stride.value_or(0) * element;
  return p;
}

at::Tensor shuffle_weight_source(const at::Tensor& w) {
  return w.dim() >= 2 && w.stride(-1) == 1 && flat_batch_stride(w) ? w : w.contiguous();
}

namespace {

void check_scale_dtype(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.scalar_type() == at::kByte || t.scalar_type() == at::kFloat8_e8m0fnu, op, ": ",
              arg, " must be uint8 or float8_e8m0fnu, got ", t.scalar_type());
}

// x >= 0 rounded up to a multiple of to; saturates where that would overflow (an m or n
// given to e8m0_unshuffle near 2^63), which no tensor's extent matches.
int64_t round_up(int64_t x, int64_t to) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  return x > kMax - (to - 1) ? kMax : (x + to - 1) / to * to;
}

E8m0ShuffleParams make_e8m0_params(int64_t m, int64_t n, bool gate_up,
                                   std::optional<int64_t> num_experts, const char* op) {
  E8m0ShuffleParams p;
  p.m = m;
  p.n = n;
  p.padded_m = round_up(m, 256);
  p.padded_n = round_up(n, 8);
  if (gate_up) {
    TORCH_CHECK(num_experts.has_value() && *num_experts >= 1, op,
                ": gate_up=True needs num_experts (>= 1), got ",
                num_experts.has_value() ? std::to_string(*num_experts) : "None");
    TORCH_CHECK(m % *num_experts == 0 && (m / *num_experts) % 32 == 0, op,
                ": gate_up=True needs the scale rows (", m,
                ") to split into num_experts (", *num_experts,
                ") groups of 2N rows with 2N a multiple of 32");
    p.rows_per_expert = m / *num_experts;
  }
  return p;
}

}  // namespace

E8m0ShuffleParams make_e8m0_shuffle_params(const at::Tensor& scale, bool gate_up,
                                           std::optional<int64_t> num_experts, const char* op) {
  TORCH_CHECK(scale.dim() == 2, op, ": scale must be 2-D [m, n], got shape ", scale.sizes());
  check_scale_dtype(scale, op, "scale");
  E8m0ShuffleParams p = make_e8m0_params(scale.size(0), scale.size(1), gate_up, num_experts, op);
  p.scale = static_cast<const uint8_t*>(scale.data_ptr());
  p.row_stride = scale.stride(0);
  p.col_stride = scale.stride(1);
  return p;
}

E8m0ShuffleParams make_e8m0_unshuffle_params(const at::Tensor& shuffled, int64_t m, int64_t n,
                                             bool gate_up, std::optional<int64_t> num_experts,
                                             const char* op) {
  check_scale_dtype(shuffled, op, "shuffled");
  TORCH_CHECK(m >= 0 && n >= 0, op, ": m and n must be >= 0, got m=", m, ", n=", n);
  E8m0ShuffleParams p = make_e8m0_params(m, n, gate_up, num_experts, op);
  TORCH_CHECK(shuffled.dim() == 2 && shuffled.size(0) == p.padded_m &&
                  shuffled.size(1) == p.padded_n,
              op, ": shuffled must have the padded shape [", p.padded_m, ", ", p.padded_n,
              "] of a [", m, ", ", n, "] scale, got ", shuffled.sizes());
  return p;
}

}  // namespace moeext::torch_glue

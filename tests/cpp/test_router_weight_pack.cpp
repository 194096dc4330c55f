// Host unit test of csrc/cpu/router_weight_pack.h: the pack of a router weight against the
// layout's index formula, written out here on its own, on odd shapes (a narrow last tile, odd
// hidden sizes, fewer experts than one tile), strided and transposed views, and expert ranges
// that split a tile, checking that every element is written once and nothing else is.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "check.h"
#include "cpu/router_weight_pack.h"

namespace {

constexpr uint16_t kUnwritten = 0xffff;  // never a weight value below
constexpr uint16_t kOutsideView = 0xbeef;

// A distinct value per element, so a misplaced one shows.
uint16_t value(int64_t e, int64_t h) { return uint16_t((e * 769 + h * 3 + 1) % 0x7fff); }

// The element of the packed layout weight[e][h] goes to (the formula of the header comment).
int64_t packed_index(int64_t e, int64_t h, int64_t num_experts, int64_t hidden_size) {
  const int64_t pairs = (hidden_size + 1) / 2;
  const int64_t first = e / 64 * 64;
  const int64_t width = num_experts - first < 64 ? num_experts - first : 64;
  return first * pairs * 2 + (h / 2 * width + (e - first)) * 2 + h % 2;
}

struct View {
  const char* name;
  int64_t row_stride, col_stride, size;  // size: elements of the buffer under the view
};

// Row-major with padded rows, column-major (a transposed [H, E] tensor, padded), and every
// other column of a wider weight.
std::vector<View> views(int64_t e, int64_t h) {
  return {{"contiguous", h, 1, e * h},
          {"padded rows", h + 3, 1, e * (h + 3)},
          {"transposed", 1, e + 2, h * (e + 2)},
          {"every other column", 2 * h + 1, 2, e * (2 * h + 1)}};
}

void check_pack(int64_t num_experts, int64_t hidden_size, const View& view,
                const std::vector<int64_t>& splits) {
  std::vector<uint16_t> weight(size_t(view.size), kOutsideView);
  for (int64_t e = 0; e < num_experts; ++e) {
    for (int64_t h = 0; h < hidden_size; ++h) {
      weight[size_t(e * view.row_stride + h * view.col_stride)] = value(e, h);
    }
  }
  const int64_t pairs = (hidden_size + 1) / 2;
  const int64_t total = pairs * num_experts * 2;
  const int64_t guard = 16;  // past the layout's end: must stay unwritten
  std::vector<uint16_t> packed(size_t(total + guard), kUnwritten);

  // splits: the ends of consecutive expert ranges, packed one at a time. After each range,
  // exactly the elements of the experts packed so far hold values.
  int64_t begin = 0;
  for (const int64_t end : splits) {
    moeext::cpu::pack_router_weight(weight.data(), num_experts, hidden_size, view.row_stride,
                                    view.col_stride, packed.data(), begin, end);
    std::vector<char> expected_written(size_t(total), 0);
    for (int64_t e = 0; e < end; ++e) {
      for (int64_t h = 0; h < 2 * pairs; ++h) {
        const int64_t at = packed_index(e, h, num_experts, hidden_size);
        CHECK(at >= 0 && at < total, "E %lld H %lld %s: index %lld of [%lld][%lld] out of range",
              (long long)num_experts, (long long)hidden_size, view.name, (long long)at,
              (long long)e, (long long)h);
        if (at < 0 || at >= total) continue;
        expected_written[size_t(at)] = 1;
        const uint16_t want = h < hidden_size ? value(e, h) : uint16_t(0);
        CHECK(packed[size_t(at)] == want,
              "E %lld H %lld %s, experts [%lld, %lld): [%lld][%lld] at %lld is 0x%04x, want 0x%04x",
              (long long)num_experts, (long long)hidden_size, view.name, (long long)begin,
              (long long)end, (long long)e, (long long)h, (long long)at, packed[size_t(at)], want);
      }
    }
    for (int64_t i = 0; i < total + guard; ++i) {
      const bool written = i < total && expected_written[size_t(i)];
      if (!written) {
        CHECK(packed[size_t(i)] == kUnwritten,
              "E %lld H %lld %s, experts [%lld, %lld): element %lld written (0x%04x)",
              (long long)num_experts, (long long)hidden_size, view.name, (long long)begin,
              (long long)end, (long long)i, packed[size_t(i)]);
      }
    }
    begin = end;
  }
}

void test_shapes() {
  // (E, H): one expert, fewer than a tile, exactly one, one more, a narrow last tile of 2 and
  // of 63, DeepSeek-V3's 256 x 7168 in small (256 experts, a short H), odd and even H, H = 1
  // (only a half pair) and H = 0 (nothing to pack).
  const int64_t shapes[][2] = {{1, 1},   {1, 2},  {3, 7},   {63, 33}, {64, 64}, {65, 5},
                               {130, 9}, {127, 1}, {256, 10}, {200, 31}, {5, 0}, {0, 4}};
  for (const auto& s : shapes) {
    const int64_t e = s[0], h = s[1];
    for (const View& view : views(e, h)) {
      check_pack(e, h, view, {e});
      // Ranges that cut tiles anywhere, as threads may: at 1, inside the first tile, just
      // past it, and the rest.
      std::vector<int64_t> splits;
      for (int64_t end : {int64_t(1), int64_t(37), int64_t(65), e}) {
        if (end <= e && (splits.empty() || end > splits.back())) splits.push_back(end);
      }
      if (!splits.empty()) check_pack(e, h, view, splits);
    }
  }
}

// An empty range writes nothing, wherever it is.
void test_empty_range() {
  const int64_t e = 70, h = 5;
  std::vector<uint16_t> weight(size_t(e * h), 1);
  std::vector<uint16_t> packed(size_t(3 * e * 2), kUnwritten);
  moeext::cpu::pack_router_weight(weight.data(), e, h, h, 1, packed.data(), 66, 66);
  moeext::cpu::pack_router_weight(weight.data(), e, h, h, 1, packed.data(), 40, 30);
  for (const uint16_t v : packed) CHECK(v == kUnwritten, "an empty range wrote 0x%04x", v);
}

}  // namespace

int main() {
  test_shapes();
  test_empty_range();
  return moeext_test::finish("test_router_weight_pack");
}

// exp (within 1 ulp) and log1p on [0, 1] over the Vec of this ISA. Written once over Vec so
// every path shares every step; they differ only in Vec::reciprocal (exact on portable and
// AVX2, rcp14 + one Newton step on AVX-512) and, with the same bits, in how exp forms 2^n.
#pragma once

namespace moeext::cpu::MOEEXT_CPU_ISA {

// e^x = 2^n e^r from n = round(x / ln2) and r_hi = x - n * ln2_hi, the first step of the
// reduction: ln2 is split in two so that it stays exact. On r in [-ln2/2, ln2/2],
// e^r = 1 + r + r^2 q(r) with q of degree 4: a minimax fit of (e^r - 1 - r) / r^2 weighted
// for the relative error of e^r (float64, Lawson's iterations on Chebyshev nodes;
// coefficients rounded to float), 3.6e-9 relative, a twentieth of an ulp. Cephes's degree-5 q
// (as Sleef's expf has) is far more exact than the float result can hold. Over every third
// fp32 bit pattern whose exp is normal, both are within 1 ulp of the rounded exp, 3.5% of
// them 1 ulp off, and differ in the sigmoid of one in 1300. The exp is bound by vector
// operations, and degree 4 is one fewer. vexp_of_reduced gives e^r, vexp_reduced e^r scaled
// by 2^n.
MOEEXT_ALWAYS_INLINE Vec vexp_of_reduced(Vec n, Vec r_hi) {
  const Vec r = Vec::fmadd(n, Vec::set1(2.12194440e-4f), r_hi);
  Vec q = Vec::set1(1.3814539416e-3f);
  q = Vec::fmadd(q, r, Vec::set1(8.3687454462e-3f));
  q = Vec::fmadd(q, r, Vec::set1(4.1668388993e-2f));
  q = Vec::fmadd(q, r, Vec::set1(1.6666521132e-1f));
  q = Vec::fmadd(q, r, Vec::set1(4.9999994040e-1f));
  return Vec::fmadd(q, r * r, r + Vec::set1(1.0f));
}
MOEEXT_ALWAYS_INLINE Vec vexp_reduced(Vec n, Vec r_hi) {
  return Vec::scalef(vexp_of_reduced(n, r_hi), n);
}

// e^(kSign x) into e, where the layer has no scalef instruction (AVX2, portable) and every
// lane's |x| <= 87, as routers' logits are: returns whether it did. There n is in [-126, 126],
// no clamp changes x, and 2^n is one normal number: one product, scalef's bits. Outside,
// the clamps and scalef's two powers of two and NaN blend (13 instructions on AVX2) are
// needed; here they are skipped.
// V is Vec, a template parameter so that the layers with scalef need not declare the rest. The
// callers skip it there with an if constexpr of their own: a call that folds away still changed
// GCC's inlining of the AVX-512 copy.
template <int kSign, typename V = Vec>
MOEEXT_ALWAYS_INLINE bool vexp_without_scalef(V x, V& e) {
  static_assert(kSign == 1 || kSign == -1, "e^x or e^-x");
  if constexpr (V::kHasScalef) {
    return false;
  } else {
    if (!V::all_abs_le(x, 87.0f)) return false;
    const V n = V::round(x * V::set1(kSign * 1.44269504088896341f));
    const V r_hi = kSign > 0 ? V::fmadd(n, V::set1(-0.693359375f), x)
                             : V::fnmsub(n, V::set1(0.693359375f), x);
    e = V::scalef_normal(vexp_of_reduced(n, r_hi), n);
    return true;
  }
}

// e^x for x in [-104, 89] or NaN: the callers clamp.
// These exps are forced inline: on AVX2 (whose scalef takes several operations) GCC called
// vexp_clamped out of line from softmax's long rows, spilling every live vector around each
// call. The AVX-512 copy, which GCC inlined already, is unchanged.
MOEEXT_ALWAYS_INLINE Vec vexp_clamped(Vec x) {
  const Vec n = Vec::round(x * Vec::set1(1.44269504088896341f));
  return vexp_reduced(n, Vec::fmadd(n, Vec::set1(-0.693359375f), x));
}

MOEEXT_ALWAYS_INLINE Vec vexp(Vec x) {
  if constexpr (!Vec::kHasScalef) {
    Vec e;
    if (vexp_without_scalef<1>(x, e)) return e;
  }
  // Clamp with x as the second operand so a NaN x passes through. Below -104 the result
  // underflows to 0 and above 89 it overflows to inf; scalef does both exactly.
  return vexp_clamped(Vec::min(Vec::set1(89.0f), Vec::max(Vec::set1(-104.0f), x)));
}

// exp(x) for x <= 0 (or NaN): softmax's x - max. Without vexp's upper clamp, which such x
// never reach.
MOEEXT_ALWAYS_INLINE Vec vexp_nonpositive(Vec x) {
  if constexpr (!Vec::kHasScalef) {
    Vec e;
    if (vexp_without_scalef<1>(x, e)) return e;
  }
  return vexp_clamped(Vec::max(Vec::set1(-104.0f), x));
}

// exp(-x) without the negation: it folds into the product and the reduction (IEEE rounding
// is symmetric under it), bit for bit vexp(0 - x). The sigmoid's scoring is bound by vector
// operations, and the fold saves one. (vrangeps would clamp in one operation instead of two,
// but it returns the number, not a NaN x.)
MOEEXT_ALWAYS_INLINE Vec vexp_neg(Vec x) {
  if constexpr (!Vec::kHasScalef) {
    Vec e;
    if (vexp_without_scalef<-1>(x, e)) return e;
  }
  x = Vec::min(Vec::set1(104.0f), Vec::max(Vec::set1(-89.0f), x));
  const Vec n = Vec::round(x * Vec::set1(-1.44269504088896341f));
  return vexp_reduced(n, Vec::fnmsub(n, Vec::set1(0.693359375f), x));
}

// log(1 + t) for t in [0, 1] as 2 atanh(s), s = t / (2 + t) in [0, 1/3]: an odd series in s
// whose tail z = s^2 <= 1/9 a degree-4 fit covers to 5e-9 relative (fitted to atanh(s) / s
// in float64 on Chebyshev nodes, coefficients rounded to float). About a third of the
// operations of log(1 + t) through a general log, and no divide: the reciprocal's error is far below
// the rounding of 2 + t.
// Formed in u = 2s = t (2 / (2 + t)): 2 atanh(s) = u + u z q(z) with z = u^2 / 4, the 4 folded
// into q's coefficients (c_k / 4^(k+1), exact). Every step is the plain form's scaled by a
// power of two, so the bits are the same wherever s is a normal float, with as many operations
// of each kind. But a subnormal t (sqrt-softplus of a logit below -87.3) comes back as itself,
// log1p's rounded value there, where halving it into s dropped its last bit (the smallest to
// 0): scores a few percent off once the square root is taken, and tied where the experts'
// logits differ.
inline Vec vlog1p_unit(Vec t) {
  const Vec r = Vec::reciprocal(t + Vec::set1(2.0f));
  const Vec u = t * (r + r);
  const Vec z4 = u * u;  // 4 z
  Vec q = Vec::set1(0.14007562f * 0x1p-8f);
  q = Vec::fmadd(q, z4, Vec::set1(0.14000423f * 0x1p-6f));
  q = Vec::fmadd(q, z4, Vec::set1(0.2001081f * 0x1p-4f));
  q = Vec::fmadd(q, z4, Vec::set1(0.33333206f * 0x1p-2f));  // q(z) / 4
  return Vec::fmadd(u * z4, q, u);
}

}  // namespace moeext::cpu::MOEEXT_CPU_ISA

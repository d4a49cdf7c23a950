// Binary search over match lengths, written once for every drafter.
//
// The properties the drafters search for are monotone in the match length m (the context's last m
// tokens): a shorter suffix occurs wherever a longer one does, at least as often, and continues
// wherever it does; so "is indexed", "continues", "occurs more than f times" hold up to some length and
// fail beyond it, while "occurs once" fails up to some length and holds beyond it. The searches probe
// only midpoints strictly inside [lo, hi] and never the end the caller vouches for.
#pragma once

#include <cstdint>

namespace reprise {

// The largest m in [lo, hi] with holds(m), for a property that holds up to some length and fails
// beyond it. holds(lo) is taken as true and never asked.
template <typename Holds>
uint32_t last_holding(uint32_t lo, uint32_t hi, Holds&& holds) {
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo + 1) / 2;
    if (holds(mid))
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The smallest m in [lo, hi] with holds(m), for a property that fails up to some length and holds
// beyond it. holds(hi) is taken as true and never asked.
template <typename Holds>
uint32_t first_holding(uint32_t lo, uint32_t hi, Holds&& holds) {
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (holds(mid))
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

// The largest m in [1, hi] with holds(m), 0 when none (holds(0) is never asked). hi is asked first:
// a match that kept growing since the previous draft costs one probe.
template <typename Holds>
uint32_t longest_holding(uint32_t hi, Holds&& holds) {
  if (hi == 0 || holds(hi)) return hi;
  return last_holding(0, hi - 1, holds);
}

}  // namespace reprise
